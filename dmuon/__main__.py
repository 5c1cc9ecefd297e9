"""Command line: ``python -m dmuon <subcommand> ...`` (console script ``dmuon``).

Subcommands:
  plan     print the owner plan of a preset model or a Hugging Face config.json on a G x R mesh.
  project  project the step time of FSDP2 + AdamW against FSDP2 + dmuon on a machine model.

New subcommands register a parser in :func:`build_parser` and a handler taking the parsed args and
returning an exit code.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]


def _cmd_plan(args: argparse.Namespace) -> int:
    from dmuon.functional.plan import plan_owners
    from dmuon.tools.plan_report import plan_summary, plan_table, strategy_rows, strategy_table
    from dmuon.tools.presets import get_preset, preset_from_hf_config, preset_specs
    from dmuon.tools.step_bytes import step_bytes_per_rank
    from dmuon.functional.split_plan import executed_entries

    from dmuon.tools.plan_views import hf_config_specs, views_summary

    policy = None
    if args.model:
        preset = get_preset(args.model)
        specs = preset_specs(preset, dtype=args.dtype)
        title = (f"model {preset.name}: hidden {preset.hidden}, intermediate {preset.intermediate}, "
                 f"layers {preset.layers}, heads {preset.heads}/{preset.kv_heads} kv, vocab "
                 f"{preset.vocab}, dtype {args.dtype}")
    else:
        got = hf_config_specs(args.config, dtype=args.dtype, per_head=args.per_head,
                              split_fused=args.split_fused)
        if got is None:  # no transformers: the Llama / Qwen-style reader
            if args.per_head or args.split_fused:
                raise SystemExit("dmuon plan: --per-head / --split-fused need transformers installed")
            preset = preset_from_hf_config(args.config)
            specs = preset_specs(preset, dtype=args.dtype)
            title = (f"model {preset.name} (config reader): hidden {preset.hidden}, layers "
                     f"{preset.layers}, dtype {args.dtype}")
        else:
            specs, policy, title = got
    t0 = time.perf_counter()
    plan = plan_owners(specs, args.shard, args.replicate, ns_steps=args.ns_steps,
                       max_split=args.max_split, node_size=args.node_size)
    seconds = time.perf_counter() - t0
    owners, entries = executed_entries(plan, specs)   # as the optimizer places them
    comm = step_bytes_per_rank(owners, {n: e[0] for n, e in entries.items()},
                               {n: e[1] for n, e in entries.items()}, args.shard, args.replicate,
                               collectives=args.collectives)
    state = _state_per_rank(plan, entries, args)
    if args.json:
        summ = plan_summary(plan, comm_bytes_per_rank=comm, planning_seconds=seconds)
        summ["muon_state"] = state
        summ["model"] = title.split(":")[0].removeprefix("model ").split(" (")[0]
        summ["views"] = views_summary(specs)
        summ["policy"] = None if policy is None else policy.canonical()
        summ["strategy"] = strategy_rows(plan, specs)
        summ["collectives"] = args.collectives
        print(json.dumps(summ, indent=2))
    else:
        print(title)
        if policy is not None:
            print(policy.describe())
        print("matrix views (Muon params): " + "; ".join(
            f"{k}: {v['params']} params, {v['matrices']} matrices"
            for k, v in views_summary(specs).items()))
        print(plan_table(plan, comm_bytes_per_rank=comm, planning_seconds=seconds, max_rows=args.max_rows))
        if args.collectives != "per_owner":
            print(f"communication counted with collectives={args.collectives!r} (per bucket: "
                  "padded parts included; grouped: the per-owner bytes; dmuon project "
                  "--collectives times it)")
        where = "host (offloaded)" if state["offload_state"] else "device"
        from dmuon.tools.plan_report import format_bytes
        print(f"Muon state per rank ({state['momentum_dtype']}, on the {where}): max "
              f"{format_bytes(state['max_bytes'])}, min {format_bytes(state['min_bytes'])}, "
              f"all ranks {format_bytes(state['total_bytes'])}")
        print("per-matrix strategy (where each matrix's Newton-Schulz runs and why):")
        print(strategy_table(strategy_rows(plan, specs), max_rows=args.max_rows or 20))
    return 0


def _state_per_rank(plan, entries, args) -> dict:
    """Per-rank bytes of the owners' Muon state for the plan (:mod:`dmuon.functional.memory_model`)."""
    import math

    from dmuon.functional.memory_model import owner_state_bytes
    from dmuon.functional.specs import dtype_from_str
    from dmuon.functional.state_dtype import check_state_dtype

    from dmuon.functional.split_plan import runtime_owners

    dt = check_state_dtype(args.momentum_dtype, "--momentum-dtype")
    owners = runtime_owners(plan)  # a split matrix's state: whole on its runtime owner
    per: dict = {}
    for n, (shape, dtype) in entries.items():
        work = "torch.float64" if dtype_from_str(dtype).itemsize > 4 else "torch.float32"
        per.setdefault((owners[n], work), {})[n] = math.prod(shape)
    by_rank: dict = {}
    for (coord, work), numels in per.items():
        by_rank[coord] = by_rank.get(coord, 0) + owner_state_bytes(numels, dt, working=work)
    vals = list(by_rank.values()) or [0]
    return {"momentum_dtype": str(dt), "offload_state": bool(args.offload_state),
            "per_rank_bytes": {f"{c[0]},{c[1]}": b for c, b in sorted(by_rank.items())},
            "max_bytes": max(vals), "min_bytes": min(vals), "total_bytes": sum(vals)}


def _cmd_project(args: argparse.Namespace) -> int:
    import dataclasses

    from dmuon.tools.calibration import calibration_rows, calibration_table
    from dmuon.tools.machine import MACHINES
    from dmuon.tools.presets import get_preset, preset_from_hf_config
    from dmuon.tools.projection import StepSetup, project_step
    from dmuon.tools.projection_report import (machine_summary, projection_summary,
                                                    projection_table, sensitivity)

    preset = get_preset(args.model) if args.model else preset_from_hf_config(args.config)
    machine = MACHINES[args.machine]
    values = {}
    for item in args.set or ():
        key, _, value = item.partition("=")
        if not value:
            raise ValueError(f"--set wants NAME=VALUE, got {item!r}")
        values[key.strip()] = float(value)
    if values:
        machine = machine.with_values(**values)
    if args.gpus_per_node:
        machine = dataclasses.replace(machine, gpus_per_node=args.gpus_per_node)
    setup = StepSetup(preset, args.shard, args.replicate, micro_batch=args.micro_batch, seq=args.seq,
                      fsdp_reshard=args.fsdp_mode == "z3", dmuon_reshard=args.mode == "z3",
                      reduce_bytes=args.reduce_bytes,
                      max_split=args.max_split if args.max_split is not None else (
                          1 if args.ns_overlap else 8),
                      ns_steps=args.ns_steps, collectives=args.collectives,
                      ns_overlap=bool(args.ns_overlap))
    if args.ns_overlap and args.ns_overlap != machine.ns_overlap_key:
        machine = dataclasses.replace(machine, ns_overlap_key=args.ns_overlap)
    projections = [project_step(setup, machine, d) for d in args.designs.split(",")]
    summ = projection_summary(setup, machine, projections)
    summ["sensitivity"] = sensitivity(setup, machine, projections)
    summ["calibration"] = calibration_rows(machine)
    if args.png:
        from dmuon.tools.projection_plot import write_timeline_png
        write_timeline_png(args.png, projections, title=f"{preset.name} {setup.world} {machine.name}")
    if args.json:
        summ["machine_constants"] = machine_summary(machine)
        print(json.dumps(summ, indent=2))
    else:
        print(projection_table(summ))
        print(calibration_table(summ["calibration"]))
        if args.png:
            print(f"wrote {args.png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``dmuon`` argument parser with one sub-parser per subcommand."""
    from dmuon.tools.presets import PRESETS

    import dmuon

    parser = argparse.ArgumentParser(prog="dmuon", description="dmuon: distributed Muon tools")
    parser.add_argument("--version", action="version", version=f"dmuon {dmuon.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("plan", help="print the owner plan of a model on a shard x replicate mesh",
                       description="Plan which rank owns each Muon matrix and print per-rank loads.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(PRESETS), help="built-in model shape preset")
    src.add_argument("--config", metavar="PATH",
                     help="Hugging Face config.json or model folder (any causal LM transformers "
                          "builds: dense, MoE, MLA; without transformers: Llama/Qwen-style)")
    p.add_argument("--per-head", action="store_true",
                   help="per-head views of q/k/v/o (dmuon.functional.hf_policy.hf_rules)")
    p.add_argument("--split-fused", action="store_true",
                   help="split fused qkv_proj / gate_up_proj / GPT-2 c_attn into their parts")
    p.add_argument("--shard", "-G", type=int, required=True, help="shard group size G")
    p.add_argument("--replicate", "-R", type=int, default=1, help="HSDP replicas R (default 1)")
    p.add_argument("--ns-steps", type=int, default=5, help="Newton-Schulz iterations (default 5)")
    p.add_argument("--dtype", default="torch.bfloat16", help="param dtype (default torch.bfloat16)")
    p.add_argument("--max-rows", type=int, default=64,
                   help="show at most this many ranks in the table (default 64; 0 = all)")
    p.add_argument("--max-split", type=int, default=1,
                   help="split a matrix's Newton-Schulz over up to this many ranks of one node where "
                        "that lowers the largest rank cost (default 1: never; the plan "
                        "dedicate_params(..., split_ns=k) builds and dmuon.Muon executes)")
    p.add_argument("--node-size", type=int, default=8, help="ranks per node (default 8)")
    p.add_argument("--momentum-dtype", default="fp32",
                   help="owners' Muon momentum dtype: fp32 (default), bf16, fp8 (per-rank state "
                        "bytes as dmuon.Muon(momentum_dtype=...) allocates them)")
    p.add_argument("--offload-state", action="store_true",
                   help="the owners' Muon state in host memory (dmuon.Muon(offload_state=True))")
    p.add_argument("--collectives", choices=("per_owner", "per_bucket", "grouped", "sharded", "auto"),
                   default="per_owner",
                   help="count the communication with this shard-axis style "
                        "(dedicate_params(collectives=...); default per_owner)")
    p.add_argument("--json", action="store_true", help="print the summary dict as JSON")
    p.set_defaults(func=_cmd_plan)

    from dmuon.tools.machine import MACHINES
    p = sub.add_parser("project", help="project step time at scale: FSDP2 + AdamW vs FSDP2 + dmuon",
                       description="Build the owner plan and the schedules, then time one step on a "
                                   "machine model (dmuon.tools.projection).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(PRESETS), help="built-in model shape preset")
    src.add_argument("--config", metavar="PATH",
                     help="Hugging Face config.json or model folder (dense or MoE)")
    p.add_argument("--shard", "-G", type=int, required=True, help="shard group size G")
    p.add_argument("--replicate", "-R", type=int, default=1, help="HSDP replicas R (default 1)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU (default 1)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--machine", choices=sorted(MACHINES), default="h200",
                   help="machine model (default h200)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="override a machine constant, e.g. nvlink_busbw=4e11, ib_alpha_hop=1e-5, "
                        "mfu_fwd=0.6 (repeatable)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="override the machine's 8 per node")
    p.add_argument("--mode", choices=("z2", "z3"), default="z3", help="dmuon's reshard mode (default z3)")
    p.add_argument("--fsdp-mode", choices=("z2", "z3"), default="z3",
                   help="FSDP2 reshard_after_forward for its params (default z3)")
    p.add_argument("--reduce-bytes", type=int, choices=(2, 4), default=4,
                   help="bytes per gradient element reduced (4: fp32 reduce_dtype, default; 2: bf16)")
    p.add_argument("--max-split", type=int, default=None,
                   help="split a matrix's NS over up to this many ranks of a node when it shortens "
                        "the projected step (default 8, or 1 with --ns-overlap; 1: never)")
    p.add_argument("--ns-steps", type=int, default=5, help="Newton-Schulz iterations (default 5)")
    p.add_argument("--collectives", choices=("per_owner", "per_bucket", "grouped", "sharded", "auto"),
                   default="per_owner",
                   help="dmuon's shard-axis style per hook group: one broadcast / reduce per owner "
                        "bucket (default), one padded all-gather / reduce-scatter per group, "
                        "grouped (each phase's per-owner ops as one NCCL group call), sharded "
                        "(each rank keeps 1/G of a group's gathered copy: one all-gather), or "
                        "auto (chosen per group by this machine's collective times)")
    p.add_argument("--ns-overlap", nargs="?", const="layer_backward_s", default=None,
                   choices=("layer_backward_s", "tokens"),
                   help="owner Newton-Schulz overlapped with the backward: a group's NS starts when "
                        "its reduce lands, at the GPU share the backward leaves idle, fitted on "
                        "measurements (dmuon.tools.ns_overlap) and keyed by one layer's backward "
                        "time (default) or by tokens per GPU; needs --max-split 1")
    p.add_argument("--designs", default="adamw,dmuon",
                   help="comma-separated: adamw, dmuon, reference (default adamw,dmuon)")
    p.add_argument("--png", metavar="PATH", help="write the timeline PNG here")
    p.add_argument("--json", action="store_true", help="print the summary (and the machine) as JSON")
    p.set_defaults(func=_cmd_project)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit code (2 with a message on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "max_rows", None) == 0:
        args.max_rows = None
    try:
        return args.func(args)
    except (ValueError, KeyError, OSError) as e:
        parser.exit(2, f"dmuon {args.command}: error: {e}\n")
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
