"""NeMo-RL's Megatron policy-worker path with areal_lce.integrations.nemo_rl_worker applied (fused op on the
decoder's hidden states) against the same path on materialised logits, on 2 gloo ranks.

    python -m torch.distributed.run --nproc_per_node=2 tests/integrations/nemo_rl_worker_cases.py OUT.json PEERS

PEERS/nemo_rl/full/nemo_rl/...: NeMo-RL's files (FILES below) extracted from the snapshot (PEERS/COMMITS),
loaded by path in these ranks only. Real: train.py (forward_with_post_processing_fn, model_forward,
apply_temperature_scaling, LossPostProcessor, LogprobsPostProcessor), the loss package (ClippedPGLossFn,
NLLLossFn, prepare_loss_input, prepare_packed_loss_input, SequencePackingLossWrapper,
SequencePackingFusionLossWrapper), BatchedDataDict, model_utils (its patched GPTModel.forward for the fused
path and the logits functions), data.py's `_pack_sequences_for_megatron` and setup.py's
`_apply_parallelism_config` (both taken out of their files by name: the rest of those files needs
megatron-bridge). Stubbed: megatron's parallel_state getters (the case's TP / CP gloo groups), NeMo-RL modules
off this path (STUBS: data/multimodal/packing, collectives, x_token, dtensor, chat templates, logger, router
replay, draft capture, model config), and, without CUDA, areal_lce.megatron.compat.cpu_shims() (`Tensor.cuda`,
megatron's `current_device`) and `pin_memory` in model_utils (AllGatherCPTensor's backward moves a 2-element
index with them, so NeMo-RL's CP backward runs here as it is). The model is megatron's GPTModel class
with a stand-in body: the decoder's output is a leaf [T/(cp·tp), B', H] (this rank's share), the logits route
all-gathers it over TP (megatron's sequence-parallel gather) and multiplies by the weight shard in the model
dtype, as megatron's output layer does.
Rank 0 writes {case: {metric: [error, bound]}}: error = max |Δ| / max(1, max |ref|), worst over ranks.
"""
from __future__ import annotations

import ast
import contextlib
import json
import os
import sys
import types
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

from areal_lce.integrations import nemo_rl_worker as lce_worker  # noqa: E402

FILES = ("models/megatron/train.py", "models/megatron/data.py", "models/megatron/common.py",
         "models/megatron/setup.py", "algorithms/loss/__init__.py", "algorithms/loss/interfaces.py",
         "algorithms/loss/loss_functions.py", "algorithms/loss/utils.py", "algorithms/loss/wrapper.py",
         "algorithms/utils.py", "algorithms/logits_sampling_utils.py", "distributed/batched_data_dict.py",
         "distributed/model_utils.py")
STUBS = ("nemo_rl.data", "nemo_rl.data.multimodal_utils", "nemo_rl.data.packing", "nemo_rl.data.chat_templates",
         "nemo_rl.distributed.collectives", "nemo_rl.algorithms.x_token", "nemo_rl.algorithms.x_token.loss_utils",
         "nemo_rl.models.dtensor", "nemo_rl.models.dtensor.parallelize", "nemo_rl.models.policy",
         "nemo_rl.models.generation", "nemo_rl.models.generation.interfaces", "nemo_rl.utils",
         "nemo_rl.utils.fastokens", "nemo_rl.utils.logger", "nemo_rl.models.megatron.config",
         "nemo_rl.models.megatron.data", "nemo_rl.models.megatron.draft", "nemo_rl.models.megatron.draft.hidden_capture",
         "nemo_rl.models.megatron.router_replay", "nemo_rl.models.megatron.setup")
V, H, TEMPERATURE = 80, 16, 0.7
LENGTHS, S = (7, 12, 13), 13  # the last sequence's padded length absorbs the pack padding past S
GROUPS = {"tp": None, "cp": None}  # the case's groups, read by the parallel_state stubs


class Stub(types.ModuleType):
    """A NeMo-RL module off the tested path: any name imported from it is a placeholder class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def function_from(path: str, name: str, namespace: dict):
    """One top-level function of a source file, compiled in `namespace` (the file's other code is not run)."""
    tree = ast.parse(open(path).read(), path)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module([node], []), path, "exec"), namespace)
    return namespace[name]


def load_nemo_rl(peers: str):
    """NeMo-RL's train module and the functions the cases call, from PEERS/nemo_rl/full (module docstring)."""
    root = os.path.join(peers, "nemo_rl", "full")
    for pkg in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.distributed", "nemo_rl.models", "nemo_rl.models.megatron"):
        mod = sys.modules.setdefault(pkg, types.ModuleType(pkg))
        mod.__path__ = [os.path.join(root, *pkg.split("."))]
    for name in STUBS:
        sys.modules[name] = Stub(name)
    sys.modules["nemo_rl.models.megatron.draft.hidden_capture"].get_capture_context = \
        lambda model, enabled: (contextlib.nullcontext(), None)
    sys.modules["nemo_rl.models.dtensor.parallelize"].to_local_if_dtensor = lambda t: t
    from megatron.core import parallel_state as ps
    ps.get_tensor_model_parallel_group = lambda *a, **k: GROUPS["tp"]
    ps.get_tensor_model_parallel_rank = lambda *a, **k: dist.get_rank(GROUPS["tp"])
    ps.get_context_parallel_group = lambda *a, **k: GROUPS["cp"]
    ps.get_context_parallel_world_size = lambda *a, **k: dist.get_world_size(GROUPS["cp"])
    import importlib
    mu = importlib.import_module("nemo_rl.distributed.model_utils")
    if not torch.cuda.is_available():  # AllGatherCPTensor.backward: torch.tensor(..., pin_memory=True).cuda()
        shim = types.ModuleType("torch")
        shim.__getattr__ = lambda name: getattr(torch, name)
        shim.tensor = lambda *a, pin_memory=False, **k: torch.tensor(*a, **k)
        mu.torch = shim  # .cuda(): cpu_shims() (main)
    train = importlib.import_module("nemo_rl.models.megatron.train")
    from megatron.core.packed_seq_params import PackedSeqParams
    mega = os.path.join(root, "nemo_rl", "models", "megatron")
    ns = dict(torch=torch, Optional=Optional, Any=Any, PackedSeqParams=PackedSeqParams,
              _get_tokens_on_this_cp_rank=mu._get_tokens_on_this_cp_rank, PolicyConfig=dict)
    function_from(os.path.join(mega, "common.py"), "_round_up_to_multiple", ns)
    pack = function_from(os.path.join(mega, "data.py"), "_pack_sequences_for_megatron", ns)
    setup = sys.modules["nemo_rl.models.megatron.setup"]
    setup._apply_parallelism_config = function_from(os.path.join(mega, "setup.py"), "_apply_parallelism_config", ns)
    return train, mu, pack, importlib.import_module("nemo_rl.algorithms.loss")


def tiny_gpt_class():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    class TinyGPT(GPTModel):
        """GPTModel's class (NeMo-RL patches its forward) with a stand-in body (module docstring)."""

        def __init__(self, h_local, w_local, tp_group, cp_group):
            """this rank's decoder output and weight shard; the vocabulary is the tp shards' rows"""
            torch.nn.Module.__init__(self)
            self.h = torch.nn.Parameter(h_local.clone())
            self.output_layer = torch.nn.Module()
            self.output_layer.weight = torch.nn.Parameter(w_local.clone())
            self.tp_group, self.cp_group = tp_group, cp_group
            self.vocab_size = w_local.shape[0] * dist.get_world_size(tp_group)
            self.post_process, self.share_embeddings_and_output_weights = True, False

        def _preprocess(self, **kwargs):
            return (None,) * 6

        def decoder(self, hidden_states=None, **kwargs):
            return self.h * 1.0

        def _original_forward_for_linear_ce_fusion(self, input_ids=None, position_ids=None, attention_mask=None, **kw):
            h = self.decoder()
            if dist.get_world_size(self.tp_group) > 1:
                h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
            return torch.matmul(h, self.output_layer.weight.t()).transpose(0, 1).contiguous()  # [B', T/cp, V/tp]
    return TinyGPT


def batch(rank_cp: int, cp: int, tp: int, packed: bool, mu, pack, vocab: int = V):
    """(ProcessedMicrobatch-like namespace, this rank's hidden [rows, B', H] from the full one, full weight)."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(vocab, H, generator=g)
    weight[3] = 0.0  # an all-zero row: a tie column in every row's softmax
    b = len(LENGTHS)
    ids = torch.randint(0, vocab, (b, S), generator=g)
    lengths = torch.tensor(LENGTHS)
    token_mask = (torch.arange(S)[None] < lengths[:, None]).float()
    data = dict(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(b),
                advantages=torch.randn(b, S, generator=g), prev_logprobs=-torch.rand(b, S, generator=g),
                generation_logprobs=-torch.rand(b, S, generator=g),
                reference_policy_logprobs=-torch.rand(b, S, generator=g))
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    data_dict = BatchedDataDict(data)
    if not packed:
        hidden = 2 * torch.randn(S, b, H, generator=g)
        return types.SimpleNamespace(
            data_dict=data_dict, input_ids=ids, input_ids_cp_sharded=ids, attention_mask=None, position_ids=None,
            packed_seq_params=None, cu_seqlens_padded=None, mtp_loss_mask=None, routed_experts_cp_sharded=None,
            media_token_validity_mask=None), hidden, weight
    factor = (2 * cp if cp > 1 else 1) * tp
    all_ids, local_ids, psp, cu, cu_padded = pack(ids, lengths, factor, 2 * factor, None, rank_cp, cp)
    hidden_full = 2 * torch.randn(int(cu_padded[-1]), 1, H, generator=g)
    local = torch.cat([mu._get_tokens_on_this_cp_rank(hidden_full[int(s):int(e)], rank_cp, cp, seq_dim=0)
                       for s, e in zip(cu_padded[:-1], cu_padded[1:])])
    mb = types.SimpleNamespace(
        data_dict=data_dict, input_ids=all_ids, input_ids_cp_sharded=local_ids, attention_mask=None,
        position_ids=None, packed_seq_params=psp, cu_seqlens_padded=cu_padded, mtp_loss_mask=None,
        routed_experts_cp_sharded=None, media_token_validity_mask=None)
    return mb, local, weight


def err(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / max(1.0, float(ref.abs().max())))


def run_path(train, loss_pkg, model, mb, fused: bool, consumer: str, fuse_loss: bool = False):
    """NeMo-RL's forward step + its post-processor on one micro-batch -> (logprobs or loss, d_h, d_w)."""
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
    sampling = TrainingSamplingParams(temperature=TEMPERATURE)
    cfg = {"sequence_packing": {"enabled": mb.packed_seq_params is not None, "fuse_loss": fuse_loss},
           "logprob_chunk_size": None}
    model.zero_grad(set_to_none=True)
    if consumer == "logprobs":
        post = train.LogprobsPostProcessor(cfg, sampling, use_fused_linear_logprobs=fused)
    else:
        loss_fn = loss_pkg.ClippedPGLossFn(loss_pkg.ClippedPGLossConfig(), use_fused_linear_logprobs=fused) \
            if consumer == "grpo" else loss_pkg.NLLLossFn(use_fused_linear_logprobs=fused)
        post = train.LossPostProcessor(loss_fn, cfg, num_microbatches=1, sampling_params=sampling)
    valid = mb.data_dict["token_mask"][:, 1:].sum()
    out, fn = train.forward_with_post_processing_fn(
        iter([mb]), model, post, sampling_params=sampling, use_fused_linear_logprobs=fused,
        global_valid_seqs=torch.tensor(float(len(LENGTHS))), global_valid_toks=valid)
    loss, metrics = fn(out)
    if consumer == "logprobs":
        return metrics["logprobs"], None, None
    loss.backward()
    return loss, model.h.grad, model.output_layer.weight.grad


def compare(train, loss_pkg, tiny, mb, h, w, tp_group, cp_group, consumer, fuse_loss=False, **options):
    """The logits route (NeMo-RL's own, no patch) vs the fused route (apply()): errors and bounds."""
    lce_worker.remove()
    ref = run_path(train, loss_pkg, tiny(h, w, tp_group, cp_group), mb, False, consumer, fuse_loss)
    lce_worker.apply(lift_checks=False, backend="torch", **options)
    try:
        got = run_path(train, loss_pkg, tiny(h, w, tp_group, cp_group), mb, True, consumer, fuse_loss)
    finally:
        lce_worker.remove()
    res = {"logprobs" if consumer == "logprobs" else "loss": [err(got[0], ref[0]), 1e-5]}
    if consumer != "logprobs":
        res.update(d_hidden=[err(got[1], ref[1]), 1e-4], d_weight=[err(got[2], ref[2]), 1e-4],
                   zero_grad=[float(ref[1].abs().max() == 0 or ref[2].abs().max() == 0), 0.0])
    return res, ref[0]


def on_policy(data_dict, logprobs) -> None:
    """GRPO's inputs near the current policy (ratios near 1, inside the clip: every token has a gradient)."""
    g = torch.Generator().manual_seed(3)
    lp = logprobs.detach()
    data_dict["prev_logprobs"] = lp + 0.05 * torch.randn(lp.shape, generator=g)
    data_dict["generation_logprobs"] = lp + 0.05 * torch.randn(lp.shape, generator=g)
    data_dict["reference_policy_logprobs"] = lp - 0.1 * torch.rand(lp.shape, generator=g)


def shard(rank, tp, w, h):
    v, r = w.shape[0] // tp, h.shape[0] // tp
    return w[rank * v:(rank + 1) * v], h[rank * r:(rank + 1) * r]


def lift_case(setup) -> dict:
    """setup.py's `_apply_parallelism_config` refuses fused + CP; lift_config_checks() lifts that assert only."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage", "sequence_parallel", "context_parallel_size")
    mcfg = dict(zip(keys, (1, 1, None, None, False, 2)), use_fused_linear_logprobs=True)

    def refused(packing: bool) -> float:
        try:
            setup._apply_parallelism_config(types.SimpleNamespace(), {"megatron_cfg": mcfg,
                                                                     "sequence_packing": {"enabled": packing}})
            return 0.0
        except AssertionError:
            return 1.0
    before = refused(True)
    lce_worker.lift_config_checks()
    lifted, packing_still = refused(True), refused(False)
    lce_worker.remove()
    return {"refused_before": [1.0 - before, 0.0], "lifted": [lifted, 0.0],
            "cp_without_packing_still_refused": [1.0 - packing_still, 0.0], "refused_after_remove": [1.0 - refused(True), 0.0]}


def main():
    out_path, peers = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    from areal_lce.megatron.compat import cpu_shims
    with cpu_shims():
        run(out_path, peers, rank, world, singles)
    dist.destroy_process_group()


def run(out_path, peers, rank, world, singles):
    train, mu, pack, loss_pkg = load_nemo_rl(peers)
    mu.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=5)  # NeMo-RL's own patch of GPTModel.forward
    tiny = tiny_gpt_class()
    results = {"lift-config-checks": lift_case(sys.modules["nemo_rl.models.megatron.setup"])}
    layouts = (("tp1-unpacked", 1, 1, False), ("tp1-packed", 1, 1, True), ("cp2-packed", 2, 1, True),
               ("tp2-sp-packed", 1, 2, True))
    for name, cp, tp, packed in layouts:
        if cp * tp > world:
            continue
        tp_group = dist.group.WORLD if tp > 1 else singles[rank]
        cp_group = dist.group.WORLD if cp > 1 else singles[rank]
        GROUPS.update(tp=tp_group, cp=cp_group)
        mb, h, w = batch(rank if cp > 1 else 0, cp, tp, packed, mu, pack)
        w, h = shard(rank if tp > 1 else 0, tp, w, h)
        for consumer, fuse in (("logprobs", False), ("grpo", False), ("grpo", True), ("sft", False)):
            if fuse and not packed:
                continue
            case = f"worker-{name}-{consumer}{'-fuse_loss' if fuse else ''}"
            results[case], ref = compare(train, loss_pkg, tiny, mb, h, w, tp_group, cp_group, consumer, fuse)
            if consumer == "logprobs":
                on_policy(mb.data_dict, ref)
    if world > 1:  # TP=1 vs TP=2 (sequence parallel), invariant mode: the same logprobs, bitwise
        lps = []
        for tp in (1, 2):
            GROUPS.update(tp=dist.group.WORLD if tp > 1 else singles[rank], cp=singles[rank])
            mb, h, w = batch(0, 1, 2, True, mu, pack, vocab=256)  # 128-id shards; packed for tp=2 in both runs
            w, h = shard(rank if tp > 1 else 0, tp, w, h)
            lce_worker.apply(lift_checks=False, backend="torch", invariant=True)
            try:
                lps.append(run_path(train, loss_pkg, tiny(h, w, GROUPS["tp"], GROUPS["cp"]), mb, True, "logprobs")[0])
            finally:
                lce_worker.remove()
        results["worker-invariant-tp1-vs-tp2"] = {"logprobs": [float(not torch.equal(lps[0], lps[1])), 0.0]}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        worst = {c: {m: [max(g[c][m][0] for g in gathered), v[1]] for m, v in ms.items()} for c, ms in results.items()}
        with open(out_path, "w") as f:
            json.dump(worst, f, indent=1)


if __name__ == "__main__":
    main()
