"""Modes beside FSDP2: DDP, tensor parallelism, deferred dedication (TP after dedicate_params), meta-device init."""
