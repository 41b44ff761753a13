"""Multi-rank cases for the capture-seam and engine tests (tests/megatron/, tests/engine/; gloo, CPU).

Launched by pytest:  python -m torch.distributed.run --nproc_per_node=2 tests/helpers/megatron_worker.py OUT.json [HF_DIR]
Runs every case in one process group (each case builds fresh engines; Megatron's parallel state is
re-initialised per engine) and rank 0 writes {case_id: {metric: value}} to OUT.json; pytest asserts.
Metrics are maximum absolute differences, plus the scale they should be judged against.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import traceback
import warnings

import torch

warnings.filterwarnings("ignore")

from areal_lce.engine.microbatch import MicroBatch  # noqa: E402
from helpers.engines import tiny_engine  # noqa: E402

GREEDY_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
GREEDY_TOKENS = 5
VOCAB = 500  # true vocab; Megatron pads it to 512 at TP=2 -> the last shard holds 12 padding rows


def batch(seed: int, b: int = 2, s: int = 16, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[1, s // 2:] = -100  # right padding of the second sequence
    labels[0, 3] = vocab - 1  # a label in the last shard, next to the padding rows
    return ids, labels


def make_hf_checkpoint(path: str, family: str = "qwen2", tied: bool = False, vocab: int = VOCAB) -> None:
    """A tiny random transformers model saved as safetensors, plus transformers' own per-token
    logprobs/entropy on a fixed batch (reference.pt) for the engine to match."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(7)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=50000.0,
              tie_word_embeddings=tied, max_position_embeddings=256)
    hf_cfg = Qwen2Config(**kw) if family == "qwen2" else LlamaConfig(attention_bias=False, **kw)
    hf_cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():  # random (not zero) biases so the q/k/v bias layout is exercised
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    ids, labels = batch(3, vocab=vocab)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    mask = labels != -100
    greedy = []
    for prompt in GREEDY_PROMPTS:  # transformers' greedy continuation, one token at a time
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        greedy.append(seq[len(prompt):])
    torch.save({"ids": ids, "labels": labels, "vocab": vocab, "logprobs": torch.where(mask, lp, 0.0),
                "entropy": torch.where(mask, ent, 0.0), "greedy": greedy}, os.path.join(path, "reference.pt"))


def launch(out_dir: str, hf_dir: str = "", timeout: int = 400, pythonpath: str = "") -> dict:
    """Run this worker on 2 gloo ranks and return its results (raises with the log on failure).
    `pythonpath` is prepended to PYTHONPATH (e.g. a `pip install --target` dir of another megatron-core)."""
    from helpers.launch import torchrun

    out = os.path.join(out_dir, "worker.json")
    return torchrun(os.path.abspath(__file__), out, *([hf_dir] if hf_dir else []), timeout=timeout,
                    pythonpath=pythonpath, result=out)


@functools.lru_cache(maxsize=None)
def results() -> dict:
    """One 2-rank torchrun launch for every TP=2 case (shared by the capture, engine, generate and
    main-grad tests): the worker's results, launched once per pytest process."""
    tmp = tempfile.mkdtemp(prefix="areal_lce_mworker_")
    hf_dir = os.path.join(tmp, "hf")
    make_hf_checkpoint(hf_dir, family="qwen2", tied=False)
    return launch(tmp, hf_dir)


def pg_loss(stats, mb):
    """A loss that back-propagates through both logprobs and entropy (as RL losses do)."""
    n = (mb.labels != -100).sum().clamp(min=1)
    loss = -(stats.logprobs.sum() + 0.1 * stats.entropy.sum()) / n
    return loss, {"entropy": float(stats.entropy.detach().sum() / n)}


def engine(fused: bool, *, sp: bool, tied: bool, seam: str = "auto", lr: float = 0.0, ckpt: str = "",
           vocab: int = VOCAB, tp: int = 2, pp: int = 1, dtype: str = "fp32", pack: bool = True, cp: int = 1):
    return tiny_engine(vocab, model=dict(tie_word_embeddings=None if ckpt else tied, hf_checkpoint_dir=ckpt, dtype=dtype),
                       parallel=dict(tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp, context_parallel=cp),
                       optim=dict(lr=lr, clip_grad=0.0 if lr == 0 else 1.0), use_fused_linear_ce=fused,
                       capture_seam=seam, pack_sequences=pack)


def route_case(sp: bool, tied: bool, seam: str, dtype: str = "fp32") -> dict:
    """Fused vs materialised: stats and every parameter's finalised gradient after one backward."""
    ids, labels = batch(1)
    res = {}
    for fused in (True, False):
        e = engine(fused, sp=sp, tied=tied, seam=seam, dtype=dtype)
        st = e.token_stats(ids, labels, temperature=0.7)
        e.train_step([MicroBatch(ids, labels, 0.7)], pg_loss)
        res[fused] = (st, e.grads())
    (sa, ga), (sb, gb) = res[True], res[False]
    out = {f"d_{n}": float((x - y).abs().max()) for n, x, y in zip(sa._fields, sa, sb)}
    out["stats_scale"] = float(sb.logprobs.abs().max())
    out["d_grad_rel"] = max(float((ga[n].float() - gb[n].float()).abs().max()
                                  / gb[n].float().abs().max().clamp(min=1e-12)) for n in gb)
    out["grad_names"] = len(gb)
    out["sp_active"] = float(bool(e.gpt.output_layer.sequence_parallel))
    out["head_grad_nonzero"] = float(ga["embedding.word_embeddings.weight" if tied else "output_layer.weight"]
                                     .abs().max())
    return out


def train_case(sp: bool) -> dict:
    """10 optimizer steps, flag on vs off: per-step losses."""
    losses = {}
    for fused in (True, False):
        e = engine(fused, sp=sp, tied=False, lr=3e-3)
        losses[fused] = [e.train_step([MicroBatch(i, l) for i, l in (batch(100 + step),
                                                                                  batch(200 + step))],
                                      pg_loss)["loss"] for step in range(10)]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False]))
    return {"max_rel_loss": rel, "first": losses[False][0], "last": losses[False][-1]}


def pack_case(sp: bool) -> dict:
    """Packed (THD) vs right-padded micro-batches of the same data, both routes: per-step losses."""
    out = {}
    for fused in (True, False):
        losses = {}
        for pack in (True, False):
            e = engine(fused, sp=sp, tied=True, lr=3e-3, pack=pack)
            losses[pack] = [e.train_step([MicroBatch(i, l) for i, l in (batch(600 + step),
                                                                                     batch(700 + step, b=3, s=11))],
                                         pg_loss)["loss"] for step in range(3)]
        out[f"max_rel_loss_fused{int(fused)}"] = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False]))
    return out


def cp_case() -> dict:
    """Context parallel 2 (one replica, each rank holds the zigzag half of every sequence) vs CP=1 on the
    same 2 ranks (two data-parallel replicas fed the same micro-batches): per-step losses, statistics
    and greedy generation, fused and materialised, packed (THD) and padded (BSHD)."""
    out = {}
    for fused in (True, False):
        for pack in (True, False):
            runs = {}
            for cp in (2, 1):
                e = engine(fused, sp=False, tied=True, tp=1, lr=3e-3, pack=pack, cp=cp)
                losses = [e.train_step([MicroBatch(i, l) for i, l in (batch(800 + k), batch(900 + k, b=3, s=11))],
                                       pg_loss)["loss"] for k in range(3)]
                ids, labels = batch(950, b=3, s=13)
                st = e.token_stats(ids, labels, temperature=0.8)
                greedy = e.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 4, temperature=0.0) if pack else None
                runs[cp] = (losses, st, greedy)
            (la, sa, ga), (lb, sb, gb) = runs[2], runs[1]
            tag = f"fused{int(fused)}_pack{int(pack)}"
            out[f"max_rel_loss_{tag}"] = max(abs(a - b) / abs(b) for a, b in zip(la, lb))
            out[f"d_stats_{tag}"] = max(float((x - y).abs().max()) for x, y in zip(sa, sb))
            if pack:
                out[f"greedy_differs_{tag}"] = float(ga != gb)
    return out


def dp_case() -> dict:
    """TP=1 on 2 ranks = data parallel 2: each rank gets its own microbatch; DDP averages the grads,
    so after a step the finalised grads and parameters agree across ranks, and both routes agree."""
    rank = torch.distributed.get_rank()
    res = {}
    for fused in (True, False):
        e = engine(fused, sp=False, tied=True, tp=1, lr=1e-3)
        ids, labels = batch(300 + rank)  # different data per DP rank
        out = e.train_step([MicroBatch(ids, labels)], pg_loss)
        g = torch.cat([t.flatten() for t in e.grads().values()])
        p = torch.cat([t.detach().flatten() for t in e.parameters_named().values()])
        both = [torch.zeros_like(g) for _ in range(2)]
        torch.distributed.all_gather(both, g)
        pboth = [torch.zeros_like(p) for _ in range(2)]
        torch.distributed.all_gather(pboth, p)
        res[fused] = (out, g, float((both[0] - both[1]).abs().max()), float((pboth[0] - pboth[1]).abs().max()))
    (oa, ga, dga, dpa), (ob, gb, dgb, dpb) = res[True], res[False]
    return {"dp_grad_mismatch": max(dga, dgb), "dp_param_mismatch": max(dpa, dpb),
            "route_grad_rel": float((ga - gb).abs().max() / gb.abs().max()),
            "route_loss_rel": abs(oa["loss"] - ob["loss"]) / abs(ob["loss"]), "tokens": oa["tokens"]}


def pp_case(hf_dir: str) -> dict:
    """Pipeline parallel 2 (TP=1): forward statistics vs transformers on the checkpoint; training losses
    fused vs materialised and vs PP=1 (DP=2 fed the same data on both ranks) on the same weights."""
    ref = torch.load(os.path.join(hf_dir, "reference.pt"))
    mask = ref["labels"] != -100
    steps = [[MicroBatch(i, l) for i, l in (batch(400 + k), batch(500 + k, b=3, s=12))]
             for k in range(3)]
    out, losses, greedy = {}, {}, {}
    for pp, fused in ((2, True), (2, False), (1, True)):
        e = engine(fused, sp=False, tied=False, ckpt=hf_dir, vocab=ref["vocab"], tp=1, pp=pp, lr=1e-2)
        if pp == 2:
            st = e.token_stats(ref["ids"], ref["labels"])
            out[f"d_logprobs_pp2_fused{int(fused)}"] = float((st.logprobs - ref["logprobs"])[mask].abs().max())
            out[f"d_entropy_pp2_fused{int(fused)}"] = float((st.entropy - ref["entropy"])[mask].abs().max())
        greedy[pp] = e.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 4, temperature=0.0)
        reports = [e.train_step(mbs, pg_loss) for mbs in steps]
        losses[(pp, fused)] = [r["loss"] for r in reports]
        if pp == 2:  # DP=1: the reported tokens are this pipeline's targets, counted once over the stages
            want = [sum(mb.target_tokens() for mb in mbs) for mbs in steps]
            out[f"tokens_pp2_wrong_fused{int(fused)}"] = float([r["tokens"] for r in reports] != want)
    out["greedy_pp2_differs_from_pp1"] = float(greedy[1] != greedy[2])
    # Tied embeddings across stages: the last stage's LM-head copy must stay equal to the first
    # stage's embedding (Megatron all-reduces their grads) with the fused op producing the head grad.
    tied = {}
    for fused in (True, False):
        e = engine(fused, sp=False, tied=True, tp=1, pp=2, lr=1e-2)
        tied[fused] = [e.train_step(mbs, pg_loss)["loss"] for mbs in steps]
        w = dict(e.parameters_named())
        mine = (w.get("embedding.word_embeddings.weight") if e.dist.pp_rank == 0 else w["output_layer.weight"])
        both = [torch.zeros_like(mine) for _ in range(2)]
        torch.distributed.all_gather(both, mine.detach().contiguous())
        out[f"tied_copy_mismatch_fused{int(fused)}"] = float((both[0] - both[1]).abs().max())
    out["rel_loss_pp2_tied_fused_vs_mat"] = max(abs(a - b) / abs(b) for a, b in zip(tied[True], tied[False]))
    base = losses[(2, False)]
    out["rel_loss_pp2_fused_vs_mat"] = max(abs(a - b) / abs(b) for a, b in zip(losses[(2, True)], base))
    out["rel_loss_pp2_vs_pp1"] = max(abs(a - b) / abs(b) for a, b in zip(losses[(1, True)], base))
    return out


def hf_case(hf_dir: str, sp: bool = True) -> dict:
    """Engine logprobs and greedy generation at TP=2 (+SP; both routes) vs transformers on the same
    checkpoint."""
    ref = torch.load(os.path.join(hf_dir, "reference.pt"))
    out = {}
    for fused in (True, False):
        e = engine(fused, sp=sp, tied=False, ckpt=hf_dir, vocab=ref["vocab"])
        st = e.token_stats(ref["ids"], ref["labels"])
        mask = ref["labels"] != -100
        out[f"d_logprobs_{'fused' if fused else 'materialised'}"] = float(
            (st.logprobs - ref["logprobs"])[mask].abs().max())
        out[f"d_entropy_{'fused' if fused else 'materialised'}"] = float(
            (st.entropy - ref["entropy"])[mask].abs().max())
        out[f"greedy_differs_{'fused' if fused else 'materialised'}"] = float(
            e.generate(GREEDY_PROMPTS, GREEDY_TOKENS, temperature=0.0) != ref["greedy"])
    return out


KV_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17], [18, 19]]


def kv_case() -> dict:
    """Generation through the KV cache vs full recompute (fp32): greedy and seeded sampling, prompts of
    1-8 tokens, sequences stopping at EOS, at TP=2 (sequence parallel off and on) and PP=2. Tokens must be
    identical between the routes and across ranks, and finished sequences must leave the decode batch."""
    from areal_lce.engine.generation import decode as D

    batches, real = [], D.CachedSteps._forward

    def spy(self, ids, mask):
        batches.append(ids.shape[0])
        return real(self, ids, mask)

    D.CachedSteps._forward = spy
    out, bad = {}, []
    try:
        for name, kw in (("tp2", {}), ("tp2-sp", {"sp": True}), ("pp2", {"tp": 1, "pp": 2})):
            e = engine(True, sp=kw.pop("sp", False), tied=False, **kw)
            ids, labels = batch(21)
            before = e.token_stats(ids, labels).logprobs
            for temp in (0.0, 1.0):
                def run(kv, eos=None):
                    e.cfg.kv_cache = kv
                    return e.generate(KV_PROMPTS, 10, temperature=temp, eos_id=eos,
                                      generator=torch.Generator().manual_seed(11))
                free = run(False)
                eos = free[0][2]  # the first prompt's third token: it stops there, others run on
                batches.clear()
                gen = {kv: run(kv, eos) for kv in (True, False)}
                lengths = [len(x) for x in gen[True]]
                every = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(every, gen[True])
                key = f"{name}-t{temp:g}"
                out[f"{key}-differs"] = float(gen[True] != gen[False])
                out[f"{key}-ranks_differ"] = float(any(x != gen[True] for x in every))
                out[f"{key}-stopped"] = float(min(lengths) < 10 <= max(lengths))
                # prefill (all rows) then one forward per step; the batch shrinks as sequences stop
                out[f"{key}-dropped"] = float(batches[0] == len(KV_PROMPTS) and len(batches) == max(lengths)
                                              and batches[-1] == D.decode_batch(lengths.count(10), len(KV_PROMPTS))
                                              and batches[-1] < len(KV_PROMPTS))
                if out[f"{key}-differs"] or out[f"{key}-ranks_differ"] or not out[f"{key}-dropped"]:
                    bad.append((key, gen[True], gen[False], batches[:]))
            # sequence parallelism (off while generating) is back: same statistics as before
            out[f"{name}-stats_changed"] = float((e.token_stats(ids, labels).logprobs - before).abs().max())
            out[f"{name}-sp_restored"] = float(e.gpt.config.sequence_parallel == (name == "tp2-sp"))
    finally:
        D.CachedSteps._forward = real
    if bad:
        raise AssertionError(f"KV cache vs recompute: {bad}")
    return out


def main() -> None:
    out_path = sys.argv[1]
    hf_dir = sys.argv[2] if len(sys.argv) > 2 else ""
    cases = {
        # (sequence parallel, tied embeddings, seam): every SP x tie combination on the auto seam
        # (output_processor on megatron-core >= 0.18), plus the legacy output_layer seam forced in the
        # two combinations where its plumbing differs most (SP gather + tied weight= keyword; plain TP).
        "tp2-sp0-untied-auto": lambda: route_case(False, False, "auto"),
        "tp2-sp0-tied-auto": lambda: route_case(False, True, "auto"),
        "tp2-sp1-untied-auto": lambda: route_case(True, False, "auto"),
        "tp2-sp1-tied-auto": lambda: route_case(True, True, "auto"),
        "tp2-sp0-untied-legacy": lambda: route_case(False, False, "output_layer"),
        "tp2-sp1-tied-legacy": lambda: route_case(True, True, "output_layer"),
        # bf16 under Float16Module (the GPU configuration) with SP and tied embeddings: bf16 tolerances.
        "tp2-sp1-tied-bf16": lambda: route_case(True, True, "auto", dtype="bf16"),
        "tp2-train-sp1": lambda: train_case(True),
        "tp2-pack-sp1": lambda: pack_case(True),
        "cp2": cp_case,
        "dp2": dp_case,
        "kv-cache": kv_case,
    }
    if hf_dir:
        cases["tp2-hf-checkpoint"] = lambda: hf_case(hf_dir)
        cases["pp2"] = lambda: pp_case(hf_dir)
    from areal_lce.megatron.capture import resolve_seam
    from areal_lce.megatron.compat import megatron_version

    results = {"meta": {"megatron_version": list(megatron_version()), "auto_seam": resolve_seam("auto")}}
    for name, fn in cases.items():
        try:
            results[name] = fn()
        except Exception:  # report, keep going: pytest shows which case failed and why
            results[name] = {"error": traceback.format_exc()}
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
