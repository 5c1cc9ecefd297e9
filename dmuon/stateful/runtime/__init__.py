"""The runtime: ``dedicate_params``, the root state, hook groups, hooks, storage, process groups, the
executor, the agreement helper (decide on every rank, raise on every rank: :mod:`.agree`) and the
tensor guards (one dispatch, one allow-list: :mod:`.guard_base`, :mod:`.guards`)."""
