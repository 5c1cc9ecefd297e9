"""The setup wing: ``dedicate_params`` (the policy's decisions, the plan, the modes, the state it
attaches) and ``dmuon.release``; above every other wing of :mod:`dmuon.stateful`."""
