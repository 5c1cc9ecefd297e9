"""State dicts (dmuon's flat full dicts and torch's DTensor protocol), sharded DCP checkpoints, their bucketed transfers."""
