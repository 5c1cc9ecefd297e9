"""``dmuon plan --config`` on Hugging Face MoE / GPT-2 configs and model folders: the plan sees the
fused expert stacks per expert (DeepSeek-V3-style: shared + routed experts, dense first layer),
GPT-2's Conv1D transposed, and --per-head / --split-fused policies, as dedicate_params would."""
import json

import pytest

from dmuon.__main__ import main

pytest.importorskip("transformers")


def _save(kind, tmp_path):
    from hf_tiny import make_hf
    folder = tmp_path / kind
    make_hf(kind).config.save_pretrained(folder)
    return folder


def _plan(capsys, *args):
    assert main(["plan", "--shard", "2", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_reads_moe_configs_and_folders(tmp_path, capsys):
    # Mixtral / Qwen3-MoE: 2 layers x (gate_up, down) stacks of 4 experts; 4 attention matrices
    for kind in ("mixtral", "qwen3_moe"):
        folder = _save(kind, tmp_path)
        for src in (folder, folder / "config.json"):  # a model folder or its config.json
            out = _plan(capsys, "--config", str(src))
            assert out["views"] == {"batch(1)": {"params": 4, "matrices": 16},
                                    "matrix": {"params": 8, "matrices": 8}}, kind
    # DeepSeek-V3-style: layer 0 dense (gate/up/down), layer 1 routed experts + a shared expert;
    # MLA q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj in both
    out = _plan(capsys, "--config", str(_save("deepseek_v3", tmp_path)))
    assert out["views"] == {"batch(1)": {"params": 2, "matrices": 8},
                            "matrix": {"params": 14, "matrices": 14}}
    assert out["policy"] is None


def test_plan_gpt2_and_policies(tmp_path, capsys):
    out = _plan(capsys, "--config", str(_save("gpt2", tmp_path)))
    assert out["views"] == {"transposed(batch(0))": {"params": 8, "matrices": 8}}
    out = _plan(capsys, "--config", str(_save("gpt2", tmp_path)), "--split-fused")
    assert out["views"]["transposed(split(16+16+16,rows))"] == {"params": 2, "matrices": 6}
    out = _plan(capsys, "--config", str(_save("llama", tmp_path)), "--per-head")
    assert out["views"] == {"heads(2,rows)": {"params": 4, "matrices": 8},
                            "heads(4,cols)": {"params": 2, "matrices": 8},
                            "heads(4,rows)": {"params": 2, "matrices": 8},
                            "matrix": {"params": 6, "matrices": 6}}
    assert out["policy"][0][0] == "*.self_attn.q_proj.weight"
    assert main(["plan", "--shard", "2", "--config", str(_save("phi3", tmp_path)),
                 "--split-fused"]) == 0
    text = capsys.readouterr().out
    assert "policy rules (first match wins):" in text and "split(16+8+8,rows)" in text


def test_split_fused_splits_3d_expert_stacks_or_refuses(tmp_path, capsys):
    """transformers 5 stores MoE experts fused: ``experts.gate_up_proj`` (E, 2I, H), rows
    ``gate | up`` per expert. ``--split-fused`` must split each expert's matrix (2E matrices of
    (I, H)); a layout a row split would cut wrongly (gpt-oss: (E, H, 2I), gate / up interleaved)
    must raise naming it. Before: both stayed ``batch(1)`` (E fused matrices), no error. Now
    ``Split`` takes a stack of fused matrices (leading dims) and ``hf_rules(split_fused=True)``
    adds ``*.experts.gate_up_proj``; the experts module's layout flags are checked."""
    import torch
    import transformers as tf

    from dmuon.functional.matrix_view import Split
    # Mixtral: I = intermediate_size (24); Qwen3-MoE: moe_intermediate_size (8); 2 layers x 4 experts
    for kind, inter in (("mixtral", 24), ("qwen3_moe", 8)):
        out = _plan(capsys, "--config", str(_save(kind, tmp_path)), "--split-fused")
        assert out["views"].get(f"split({inter}+{inter},rows)") == {"params": 2, "matrices": 16}, \
            (kind, out["views"])
    x = torch.randn(4, 2 * 3, 5)  # (E, 2I, H): expert e's gate rows, then its up rows
    (blk,) = Split((3, 3)).to_blocks(x)
    assert torch.equal(blk, x.reshape(8, 3, 5)) and torch.equal(blk[3], x[1, 3:])
    assert torch.equal(Split((3, 3)).from_blocks([blk], x.shape), x)
    cfg = tf.GptOssConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                          num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    folder = tmp_path / "gpt_oss"
    cfg.save_pretrained(folder)
    with pytest.raises(SystemExit):  # the CLI prints the ValueError and exits with 2
        main(["plan", "--shard", "2", "--json", "--config", str(folder), "--split-fused"])
    err = capsys.readouterr().err
    assert "interleaved" in err and "experts.gate_up_proj" in err, err
