"""The pure functional core of dmuon: no ``torch.distributed``, no globals, explicit state."""
