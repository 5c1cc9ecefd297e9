"""The runtime: ``dedicate_params``, the root state, hook groups, hooks, storage, process groups, the executor."""
