"""The agreement helper (:mod:`dmuon.stateful.runtime.agree`): decide on every rank, raise on every
rank. The detail formats (pure) and, on 3 gloo ranks in one spawn, each function: a problem on one
rank raises the same error on all, naming that rank; equal values pass and differing ones raise;
device flags name their ranks; a NaN on one rank survives the MAX."""
from __future__ import annotations

import math

from dist_utils import catch, run_ranks

from dmuon.stateful.runtime.agree import describe_problems, describe_values


def test_describe_problems_groups_ranks_by_message():
    assert describe_problems({}) == ""
    text = describe_problems({0: ["a", "b"], 2: ["a", "b"], 1: ["c"], 3: []})
    assert text == "rank(s) [0, 2]: a; b | rank(s) [1]: c"
    # a problem two ranks share and one only rank 1 has
    assert describe_problems({0: ["x"], 1: ["x", "y"]}) == "rank(s) [0, 1]: x | rank(s) [1]: y"
    many = describe_problems({r: [f"p{r}"] for r in range(20)})
    assert "rank(s) [7]: p7" in many and "p8" not in many and "12 more groups" in many


def test_describe_values_groups_ranks_by_value():
    assert describe_values(["ab", "ab", "cd"]) == "ranks [0, 1]: ab | ranks [2]: cd"
    assert describe_values(["abcdef", "x"], show=lambda v: v[:2]) == "ranks [0]: ab | ranks [1]: x"


def test_collective_failure_names_the_collective_ranks_bound_and_fix():
    """One message for every dmuon collective that failed (executor ops, control collectives)."""
    import datetime
    from dmuon.functional.rank_report import collective_failure
    text = collective_failure("clip all-reduce", range(4), 2, datetime.timedelta(seconds=2),
                              "Timed out", "Restart. ")
    assert text.startswith("dmuon: the clip all-reduce collective failed on rank 2 (timeout "
                           "0:00:02): Timed out. A timeout means a rank of [0, 1, 2, 3] never")
    assert text.endswith("(see its log). Restart. The bound is dedicate_params(..., timeout=...).")
    assert "(timeout" not in collective_failure("x", [0, 1], 0, None, "e")
    # a peer's process gone (a user-path review, session 14: a rank killed during save_sharded
    # was reported as a call-order problem only): the message says so first
    gone = collective_failure("save agreement", [0, 1], 0, None,
                              "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert "a rank's process is gone (crashed, killed, out of memory" in gone
    assert "process is gone" not in text


class _Boom(ValueError):
    pass


def _worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from dmuon.stateful.runtime.agree import agree, agree_equal, gather, max_over_ranks, rank_flags
    from dmuon.stateful.runtime.process_groups import make_process_groups

    torch.set_num_threads(1)
    mg = make_process_groups(shard_size=world)  # its control group: what dmuon's checks use
    out: dict = {"gather": gather(rank * 10, what="t gather", via=mg),
                 "gather_default": gather(str(rank), what="t gather default")}
    out["none"] = agree([], what="t none", via=mg, payload=rank,
                        error=lambda d: _Boom(f"never: {d}"))
    out["one"] = catch(lambda: agree(["bad dict"] if rank == 1 else [], what="t one", via=mg,
                                     error=lambda d: _Boom(f"frame ({d}) end")))
    out["equal"] = agree_equal("same", what="t eq", via=mg, error=RuntimeError)
    out["differ"] = catch(lambda: agree_equal("fsdp" if rank else "ddp", what="t differ",
                                              via=dist.group.WORLD, show=repr,
                                              error=lambda d: RuntimeError(f"differs ({d})")))
    flags = rank_flags(torch.tensor([rank == 2, True]), what="t flags", via=mg)
    out["flags"] = flags.tolist()
    v = torch.tensor([float(rank), -1.0, 2.0], dtype=torch.float64)
    if rank == 1:
        v[1] = math.nan
    out["max"] = max_over_ranks(v, what="t max", via=mg).tolist()
    out["max0d"] = max_over_ranks(torch.tensor(float(rank)), what="t max", via=mg).shape
    return out


def test_agreement_on_three_ranks():
    results = run_ranks(_worker, 3)
    for rank, out in enumerate(results):
        assert out["gather"] == [0, 10, 20] and out["gather_default"] == ["0", "1", "2"]
        assert out["none"] == [0, 1, 2]
        assert out["one"] == ("_Boom", "frame (rank(s) [1]: bad dict) end"), (rank, out["one"])
        assert out["equal"] == ["same"] * 3
        assert out["differ"] == ("RuntimeError", "differs (ranks [0]: 'ddp' | ranks [1, 2]: "
                                 "'fsdp')"), out["differ"]
        assert out["flags"] == [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]
        assert out["max"][0] == 2.0 and math.isnan(out["max"][1]) and out["max"][2] == 2.0
        assert tuple(out["max0d"]) == ()
