"""State dicts (dmuon's flat full dicts and torch's DTensor protocol) and their bucketed transfers
(the file-level manager is :mod:`dmuon.checkpoint`, which imports this, never the reverse)."""
