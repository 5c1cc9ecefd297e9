"""Every code block of README.md, of the docs site's pages (docs/**/*.md) and of the examples'
docstrings runs as written, or says why not (issue 36: the README's three-line block failed
verbatim on the HF model it was meant for; issue 48: the docs site).

How a block is marked — an HTML comment (invisible when rendered) on the line above its fence:

* ``<!-- snippet: run HARNESS -->``: a ``python`` block, executed as written in a namespace that
  the harness prepares (the names the prose around the block supposes: ``model``, ``mesh``,
  ``loader``, ...; see :data:`PURE` / :data:`DIST` below). Each such name the block reads must be
  named (in backticks) in the page's visible text above the block, so a reader knows what it
  assumes. ``run HARNESS cpu`` also reads ``"cuda"`` as ``"cpu"`` (the block is the GPU recipe; CI
  has no GPU). Distributed harnesses run on 2 gloo ranks, all such blocks of every page in one
  spawn; after a block that builds ``optimizer``, the harness trains one step with it.
* ``<!-- snippet: skip REASON -->``: not executed, for the reason given (installs packages, needs
  4 ranks, ...), which the visible line right above the comment must say too (a comment alone is
  invisible when rendered): ``*Not run by the docs test: REASON.*``. Python blocks are still
  parsed, and every command line in a ``bash`` block must name files that exist and ``--flags``
  those files define.

A fenced block without a marker fails the test, so a new snippet is run or explicitly excused.
The examples' docstrings: command lines are checked like the README's bash blocks; a Python
fragment must parse and use only names its example defines. Every example file is run by a test
(:data:`EXAMPLE_TESTS`); the two that take ~40 s on the CI machine run in the slow tier here.
"""
from __future__ import annotations

import ast
import builtins
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!--\s*snippet:\s*(run|skip)\b\s*(.*?)\s*-->")


class Block(NamedTuple):
    path: str        # the page, relative to the repository root
    line: int        # 1-based line of the opening fence
    lang: str
    code: str
    mark: Any        # (kind, rest) or None
    visible: str     # the rendered text above the marker since the page's start (no comments)
    above: str       # the visible line right above the marker (or above the fence)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


COMMENT = re.compile(r"<!--.*?-->", re.S)


def readme_blocks(text: str, path: str = "README.md") -> list[Block]:
    lines, blocks, i = text.split("\n"), [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        k = next((k for k in range(i - 1, -1, -1) if lines[k].strip()), -1)
        mark = MARK.search(lines[k]) if k >= 0 else None
        top = k if mark else i
        visible = COMMENT.sub("", "\n".join(lines[:top]))
        above = next((ln for ln in reversed(visible.split("\n")) if ln.strip()), "")
        blocks.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:j]),
                            (mark.group(1), mark.group(2)) if mark else None, visible, above))
        i = j + 1
    return blocks


#: the pages whose blocks run: the README and every page of the docs site
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
BLOCKS = [b for page in PAGES for b in readme_blocks((ROOT / page).read_text(), page)]


def _ids(blocks):
    return [b.where for b in blocks]


# --------------------------------------------------------------------------- harnesses
def _pure_policy() -> dict:
    from dmuon.functional.policy import ParamPolicy, Rule
    return dict(torch=torch, ParamPolicy=ParamPolicy, Rule=Rule)


def _pure_functional() -> dict:
    from dmuon.functional import muon
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(16, 8, generator=g), "w2": torch.randn(8, 16, generator=g),
              "bias": torch.randn(8, generator=g)}
    grads = {"w1": torch.randn(16, 8, generator=g), "w2": torch.randn(8, 16, generator=g)}
    experts, q = torch.randn(4, 8, 16, generator=g), torch.randn(64, 16, generator=g)
    return dict(params=params, grads=grads, experts=experts, g_e=torch.randn_like(experts),
                st_e=muon.init(experts), q=q, g_q=torch.randn_like(q), st_q=muon.init(q))


#: harness name -> namespace for blocks run in the test process
PURE = {"policy": _pure_policy, "functional": _pure_functional}


def _common(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import dmuon
    return dict(torch=torch, dist=dist, dmuon=dmuon, init_device_mesh=init_device_mesh,
                fully_shard=fully_shard, DistributedDataParallel=DistributedDataParallel,
                world=world, rank=rank, mesh=init_device_mesh("cpu", (world,)))


def _dist_hf(rank: int, world: int, tmp: str) -> dict:
    """A tiny HF ``LlamaForCausalLM`` (what ``AutoModelForCausalLM.from_pretrained`` returns,
    without the download); ``loader`` yields this rank's token ids."""
    from hf_tiny import batches, make_hf
    ns = _common(rank, world)
    ns.update(model=make_hf("llama"), loader=[b.chunk(world)[rank] for b in batches(2)])
    ns["train"] = lambda ns: ns["model"](input_ids=ns["loader"][0], labels=ns["loader"][0]).loss
    return ns


def _dist_fsdp(rank: int, world: int, tmp: str) -> dict:
    """The tests' tiny Llama (``model.layers``; ``model(ids)`` is the loss), ``predicate``, and the
    HSDP shape ``(R, G) = (2, 1)`` on 2 ranks."""
    from models import make_batches, make_model, muon_predicate
    ns = _common(rank, world)
    ns.update(model=make_model(), predicate=muon_predicate, R=2, G=world // 2, local_rank=rank,
              loader=[b.chunk(world)[rank] for b in make_batches(2, 4)])
    ns["train"] = lambda ns: ns["model"](ns["loader"][0])
    return ns


def _dist_trained(rank: int, world: int, tmp: str) -> dict:
    """``_dist_fsdp`` prepared (``dedicate_params`` + ``fully_shard``), ``optimizer`` built and one
    step taken; the working directory is a fresh folder shared by the ranks."""
    ns = _dist_fsdp(rank, world, tmp)
    exec("dmuon.dedicate_params(model, mesh, predicate)\n"
         "for layer in model.layers: fully_shard(layer, mesh=mesh)\n"
         "fully_shard(model, mesh=mesh)\n"
         "optimizer = dmuon.Muon(model, lr=0.02)\n", ns)
    _train_step(ns)
    os.chdir(tmp)
    return ns


def _dist_meta(rank: int, world: int, tmp: str) -> dict:
    """``build_model(config)``: the tests' tiny Llama with a torchtitan-style ``init_weights``."""
    import torch.nn as nn
    from models import TinyLlama
    ns = _dist_fsdp(rank, world, tmp)

    class Model(TinyLlama):
        def init_weights(self) -> None:
            for n, p in self.named_parameters():
                nn.init.normal_(p, std=0.02) if p.ndim == 2 else nn.init.ones_(p)

    ns.update(config=dict(vocab=32, dim=16, n_layers=2), build_model=lambda c: Model(**c))
    return ns


#: harness name -> namespace for blocks run on every rank of the 2-rank gloo spawn
DIST = {"hf": _dist_hf, "fsdp": _dist_fsdp, "trained": _dist_trained, "meta": _dist_meta}


def _train_step(ns: dict) -> float:
    opt = ns["optimizer"]
    opt.zero_grad()
    loss = ns["train"](ns)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _source(block: Block) -> tuple[str, str]:
    """``(harness, code)`` of a ``run`` block (``cpu``: ``"cuda"`` read as ``"cpu"``)."""
    words = block.mark[1].split()
    code = block.code.replace('"cuda"', '"cpu"') if "cpu" in words[1:] else block.code
    return words[0], code


def _run_dist_blocks(rank: int, world: int, blocks: list, tmp: str) -> dict:
    import traceback
    out = {}
    for k, (where, harness, code) in enumerate(blocks):
        cwd = os.getcwd()
        try:
            os.makedirs(os.path.join(tmp, str(k)), exist_ok=True)
            ns = DIST[harness](rank, world, os.path.join(tmp, str(k)))
            exec(compile(code, where, "exec"), ns)
            if "optimizer" in ns and "train" in ns:  # what the block built can train
                assert torch.isfinite(torch.tensor(_train_step(ns)))
            out[where] = None
        except Exception:  # noqa: BLE001 - reported per block
            out[where] = traceback.format_exc(limit=-6)
        finally:
            os.chdir(cwd)
    return out


#: names a harness provides that are the usual imports of an FSDP2 script, which Getting started
#: states once for every page (docs/getting-started.md, "The three lines in an FSDP2 script")
_IMPORTED = {"torch", "dist", "dmuon", "init_device_mesh", "fully_shard", "DistributedDataParallel",
             "ParamPolicy", "Rule"}


def _free_names(code: str) -> set[str]:
    """Names a block reads without binding them anywhere in itself (imports, assignments, defs)."""
    tree = ast.parse(code)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(
        n.ctx, ast.Load)}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.arguments):
            bound |= {a.arg for a in n.posonlyargs + n.args + n.kwonlyargs}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - bound - set(dir(builtins))


def _harness_names(harness: str) -> set[str]:
    """What a harness defines for its blocks (without building it: its namespace's keys)."""
    return _HARNESS_NAMES[harness]


_HARNESS_NAMES = {
    "policy": {"torch", "ParamPolicy", "Rule"},
    "functional": {"params", "grads", "experts", "g_e", "st_e", "q", "g_q", "st_q"},
    "hf": {"torch", "dist", "dmuon", "init_device_mesh", "fully_shard", "DistributedDataParallel",
           "world", "rank", "mesh", "model", "loader"},
}
_HARNESS_NAMES["fsdp"] = _HARNESS_NAMES["hf"] | {"predicate", "R", "G", "local_rank"}
_HARNESS_NAMES["trained"] = _HARNESS_NAMES["fsdp"] | {"optimizer"}
_HARNESS_NAMES["meta"] = _HARNESS_NAMES["fsdp"] | {"config", "build_model"}


# --------------------------------------------------------------------------- the pages
def test_every_block_is_marked_and_says_why_it_is_skipped():
    problems = []
    for b in BLOCKS:
        if b.mark is None:
            problems.append(f"{b.where} ({b.lang or 'plain'}): no <!-- snippet: run "
                            "HARNESS --> or <!-- snippet: skip REASON --> on the line above")
        elif b.mark[0] == "skip" and len(b.mark[1]) < 12:
            problems.append(f"{b.where}: skip needs a reason")
        elif b.mark[0] == "skip" and _plain(b.mark[1]) not in _plain(b.above):
            problems.append(f"{b.where}: the skip's reason is invisible when rendered; write it "
                            f"on the line above the comment: *Not run by the docs test: "
                            f"{b.mark[1]}.*")
        elif b.mark[0] == "run" and (b.lang != "python" or not b.mark[1]
                                     or b.mark[1].split()[0] not in {**PURE, **DIST}):
            problems.append(f"{b.where}: run needs a python block and a harness of "
                            f"{sorted({**PURE, **DIST})}")
    assert not problems, "\n".join(problems)
    assert sum(b.mark is not None and b.mark[0] == "run" for b in BLOCKS) >= 8


def _plain(text: str) -> str:
    return " ".join(re.sub(r"[`*_]", "", text).lower().split())


RUN = [b for b in BLOCKS if b.mark and b.mark[0] == "run"]


def test_harness_names_match_what_the_harnesses_define():
    for name, make in PURE.items():
        assert set(make()) == _HARNESS_NAMES[name], name


def test_every_run_block_says_what_it_assumes():
    """A name a block takes from its harness (``model``, ``mesh``, ``loader``, ...) is named in
    the page's visible text above it, so a reader running the page in order knows what to bring
    (issue 48: the variants block supposed a model named only in an HTML comment)."""
    problems = []
    for b in RUN:
        taken = _free_names(b.code) & _harness_names(_source(b)[0]) - _IMPORTED
        said = {w for span in re.findall(r"`([^`\n]+)`", b.visible)
                for w in re.findall(r"\w+", span)}  # the words of the code spans above
        unsaid = sorted(taken - said)
        if unsaid:
            problems.append(f"{b.where}: the block uses {unsaid}, which the page does not name "
                            "above it")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"],
                         ids=_ids([b for b in BLOCKS if b.lang == "python"]))
def test_python_block_parses(block):
    ast.parse(block.code, block.where)


RUN_PURE = [b for b in RUN if _source(b)[0] in PURE]


@pytest.mark.parametrize("block", RUN_PURE, ids=_ids(RUN_PURE))
def test_block_runs(block):
    harness, code = _source(block)
    exec(compile(code, block.where, "exec"), PURE[harness]())


def test_distributed_blocks_run(tmp_path):
    """Every distributed block of every page, in one 2-rank spawn."""
    use_it = next(b for b in BLOCKS if b.lang == "python")  # "Use it: three lines": an HF model's
    assert use_it.path == "README.md" and use_it.mark and _source(use_it)[0] == "hf", use_it
    blocks = [(b.where, *_source(b)) for b in RUN if _source(b)[0] in DIST]
    assert len({b[0].split(":")[0] for b in blocks}) > 1, "the docs pages' blocks run too"
    results = run_ranks(_run_dist_blocks, 2, blocks, str(tmp_path), timeout=180)
    failed = [f"--- {where}, rank {r} ---\n{err}" for r, res in enumerate(results)
              for where, err in res.items() if err]
    assert not failed, "\n".join(failed)


# --------------------------------------------------------------------------- commands
_CLI = {"dmuon": ["dmuon/__main__.py", "dmuon/tools"], "dmuon.demo": ["dmuon/demo"]}


def _flag_sources(target: str) -> list[Path]:
    if target in _CLI:
        paths = [ROOT / p for p in _CLI[target]]
        return [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    return [ROOT / target]


def check_command(line: str, where: str) -> list[str]:
    """Problems of one shell command line: the files it runs exist and define its ``--flags``."""
    line = line.split(" #", 1)[0].strip()
    if not line or line.startswith("#"):
        return []
    problems = []
    for part in re.split(r"\s*&&\s*", line):
        words = shlex.split(part)
        target, flags = None, [w.split("=", 1)[0] for w in words if w.startswith("--")]
        if words[:3] == ["python", "-m", "dmuon"] or words[:3] == ["python", "-m", "dmuon.demo"]:
            target = words[2]
        elif words and words[0] in ("python", "torchrun", "bash"):
            target = next((w for w in words[1:] if w.endswith(".py") or w.startswith(".ci/")), None)
            flags = flags if target and target.endswith(".py") else []
            if words[0] == "torchrun":  # torchrun's own flags come before the script
                flags = [f for f in flags if f not in ("--nproc_per_node", "--nnodes")]
        if target is None:
            continue  # pip, pytest, ...: not ours
        sources = _flag_sources(target)
        if not all(p.exists() for p in sources):
            problems.append(f"{where}: {target} does not exist")
            continue
        text = "\n".join(p.read_text() for p in sources)
        problems += [f"{where}: {target} defines no {f}" for f in flags
                     if f'"{f}"' not in text and f"'{f}'" not in text]
    return problems


def test_commands_name_real_files_and_flags():
    problems = []
    for b in BLOCKS:
        if b.lang == "bash":
            for k, line in enumerate(b.code.split("\n")):
                problems += check_command(line, f"{b.path}:{b.line + 1 + k}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- examples
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
#: example -> the test that runs it (a new example needs an entry)
EXAMPLE_TESTS = {
    "checkpoint.py": "test_checkpoint_example.py", "custom_loop.py": "test_example_custom_loop.py",
    "ddp.py": "test_ddp.py", "functional_research.py": "test_functional_research.py",
    "hf_llama.py": "test_recipes_hf.py",
    "hf_trainer.py": "test_recipes_trainer.py", "hsdp.py": "test_hsdp.py",
    "lightning_fsdp2.py": "test_recipes_lightning.py",
    "multimodal_boundary.py": "test_multimodal_boundary.py",
    "research_transforms.py": "test_transforms.py",
    "tensor_parallel.py": "test_example_tensor_parallel.py",
    "torchtitan_style.py": "test_recipes_hf.py",
    # ~40 s each on the loaded 2-core CI machine: the slow tier, below
    "compare_torch_muon.py": "test_readme_snippets.py", "functional_muon.py": "test_readme_snippets.py",
}


def test_every_example_is_run_by_a_test():
    assert sorted(EXAMPLE_TESTS) == EXAMPLES, "a new example needs a test (EXAMPLE_TESTS)"
    for example, test in EXAMPLE_TESTS.items():
        assert example in (ROOT / "tests" / test).read_text(), (example, test)


def _docstring_blocks(path: Path) -> list[tuple[int, str]]:
    """The indented (4 spaces) blocks of a module docstring: ``(line in the docstring, text)``."""
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    blocks: list[tuple[int, list[str]]] = []
    inside = False
    for k, line in enumerate(doc.split("\n")):
        if line.startswith("    ") and line.strip():
            if not inside:
                blocks.append((k + 1, []))
            blocks[-1][1].append(line[4:])
            inside = True
        elif line.strip():
            inside = False
        elif inside:
            blocks[-1][1].append("")
    return [(k, "\n".join(lines).strip("\n")) for k, lines in blocks]


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_docstring_blocks(example):
    path = ROOT / "examples" / example
    source = path.read_text()
    defined = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)} | {
        n.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    problems = []
    for line, text in _docstring_blocks(path):
        if re.match(r"(python|torchrun)\b", text):
            for k, cmd in enumerate(text.split("\n")):
                where = f"examples/{example} docstring line {line + k}"
                if example not in cmd and cmd.strip():
                    problems.append(f"{where}: a command of another file: {cmd}")
                problems += check_command(cmd, where)
            continue
        tree = ast.parse(text, f"examples/{example} docstring line {line}")  # a Python fragment
        lambdas = {a.arg for n in ast.walk(tree) if isinstance(n, ast.Lambda) for a in n.args.args}
        unknown = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - defined - lambdas \
            - set(dir(builtins))
        problems += [f"examples/{example} docstring line {line}: {sorted(unknown)} not defined in "
                     "the example"] if unknown else []
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["compare_torch_muon.py", "functional_muon.py"])
def test_example_runs(example):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
        "PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# --------------------------------------------------------------------------- the API pages
def _source_names() -> dict:
    """Read from the source (no import: this file stays cheap): ``dmuon._PUBLIC`` and the options
    of ``Muon.__init__``, ``dedicate_params`` and the ``DedicateOptions`` fields."""
    def tree(path):
        return ast.parse((ROOT / path).read_text())

    def args(fn):
        a = fn.args
        return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg != "self"]

    init = tree("dmuon/__init__.py")
    public = next(ast.literal_eval(n.value) for n in ast.walk(init) if isinstance(n, ast.AnnAssign)
                  and getattr(n.target, "id", "") == "_PUBLIC")
    muon = next(f for c in ast.walk(tree("dmuon/stateful/optimizer/muon.py"))
                if isinstance(c, ast.ClassDef) and c.name == "Muon" for f in c.body
                if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    dedicate = next(f for f in ast.walk(tree("dmuon/stateful/setup/dedicate.py"))
                    if isinstance(f, ast.FunctionDef) and f.name == "dedicate_params")
    options = next(c for c in ast.walk(tree("dmuon/functional/dedicate_options.py"))
                   if isinstance(c, ast.ClassDef) and c.name == "DedicateOptions")
    fields = [n.target.id for n in options.body if isinstance(n, ast.AnnAssign)]
    return dict(public=public, muon=args(muon), dedicate=args(dedicate), options=fields)


def test_api_reference_documents_every_public_name():
    """docs/reference/dmuon.md renders every name of ``dmuon.__all__`` (but the subpackage)
    from the module that defines it."""
    page = (ROOT / "docs" / "reference" / "dmuon.md").read_text()
    shown = {name: module for module, name in re.findall(r"^::: ([\w.]+)\.(\w+)$", page,
                                                         flags=re.M)}
    public = _source_names()["public"]
    assert shown == public, (sorted(set(public) - set(shown)), sorted(set(shown) - set(public)))


def test_getting_started_shows_every_option_of_muon_and_dedicate_params():
    """The signatures "The API at a glance" shows leave out no option (issue 48: the README's
    ``dmuon.Muon`` left out ``transform``, ``offload_state``, ``adamw_state_dtype``, ...)."""
    names = _source_names()
    page = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    for key, head in (("muon", "`dmuon.Muon(model, "), ("dedicate", "`dmuon.dedicate_params(model, "),
                      ("options", "`options=dmuon.DedicateOptions( ")):
        shown = page[page.index(head):].split(")`", 1)[0]
        missing = [n for n in names[key] if not re.search(rf"\b{n}\b", shown)]
        assert not missing, f"{head}...) on docs/getting-started.md leaves out {missing}"
