"""Offline tools: the step-time projector, the machine model, model presets, plan and projection
reports, plots and the CLI's views (``python -m dmuon plan / project``).

They read the pure core (:mod:`dmuon.functional`, :mod:`dmuon.newton_schulz`) and nothing else of
dmuon; training never imports them (``tests/test_layout.py``).
"""
