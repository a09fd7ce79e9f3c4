"""Worker (run under torchrun, gloo): one forward/backward of a tiny megatron-core GPTModel.

Used by tests/integration/test_megatron_adapter.py to check that CP=2/4 with MTrainingAttention equals CP=1.
``--packed``: the batch holds documents ended by EOD tokens, with Megatron-LM's
``--reset-position-ids --reset-attention-mask --eod-mask-loss`` (position ids and loss mask from
megatron-core's GPTDataset rule; ``--attn local`` gets megatron-core's dense document mask).
Rank 0 writes ``--out`` (a torch file) with the global loss, the unsharded per-token losses,
the CP/DP-reduced gradients and the gradient norm. ``--cases JSON`` (a list of such argument lists)
runs several cases in turn in one process group (megatron-core's parallel state is rebuilt for each).

The loss is the exact global token mean ``sum(loss * mask) / N`` with ``N`` the loss-mask count
all-reduced over the DP x CP group (as in megatron_mtraining.training.step); gradients are reduced by
megatron-core's DistributedDataParallel with ``calculate_per_token_loss=True`` (plain sum).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SEQ, BATCH, VOCAB = 256, 2, 512
EOD = VOCAB - 1
EOD_AT = ([0, 37, 38, 100, 191], [63, 64, 130, 255])   # token indices that become EOD (documents end there)


def text_like_tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[batch, seq]`` int64 ids with a Zipf-like unigram distribution and repeated phrases
    (so attention to far-back positions matters), from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = (1.0 / ranks) / (1.0 / ranks).sum()
    toks = torch.multinomial(probs.expand(batch, -1), seq, replacement=True, generator=g)
    phrase = torch.multinomial(probs, 12, replacement=True, generator=g)
    for b in range(batch):  # paste the same phrase at a few random places
        for start in torch.randint(0, seq - 12, (4,), generator=g).tolist():
            toks[b, start:start + 12] = phrase
    return toks


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--cases":
        import json

        cases = json.loads(sys.argv[2])
    else:
        cases = [sys.argv[1:]]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    for argv in cases:
        run_case(argv)
        ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


def run_case(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attn", choices=["mtraining", "local"], default="mtraining",
                    help="local = megatron's stock DotProductAttention (CP=1 only)")
    ap.add_argument("--layout", default="striped", help="layout of attention (and by default batch + RoPE)")
    ap.add_argument("--granularity", type=int, default=64)
    ap.add_argument("--batch-layout", default=None, help="negative control: split the batch differently")
    ap.add_argument("--rope-layout", default=None, help="negative control: RoPE rows of another layout")
    ap.add_argument("--mask", choices=["full", "uneven"], default="full")
    ap.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope")
    ap.add_argument("--packed", action="store_true", help="documents ended by EOD tokens, reset positions and mask")
    ap.add_argument("--packed-no-mask", action="store_true",
                    help="negative control: with --packed, do not pass the documents to the attention")
    ap.add_argument("--ref-weights", default=None)
    ap.add_argument("--save-weights", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    world = dist.get_world_size()
    rank = dist.get_rank()

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.config import MTrainingConfig
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.megatron.batch import get_batch_on_this_cp_rank_striped
    from megatron_mtraining.megatron.cpu_compat import (
        apply_cpu_patches, cpu_seed, cpu_transformer_config_kwargs,
    )
    from megatron_mtraining.megatron.rope import install_layout_rope
    from megatron_mtraining.megatron.spec import get_gpt_layer_spec_with_mtraining

    apply_cpu_patches()
    cp = world
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
    cpu_seed(1234)
    cp_group = ps.get_context_parallel_group()
    cp_rank = ps.get_context_parallel_rank()

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
        context_parallel_size=cp, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", calculate_per_token_loss=True, **cpu_transformer_config_kwargs(),
    )
    attn_layout = Layout(args.layout, cp_size=cp, granularity=args.granularity)
    mt_config = MTrainingConfig(implementation=args.layout, granularity=args.granularity)
    plan = None
    if args.packed and args.attn != "local":       # the run's plan, with its packing, for every consumer
        from megatron_mtraining.plan import DocumentPacking, resolve

        plan = mt_config = resolve(mt_config, cp_group=cp_group, packing=DocumentPacking(
            reset_attention_mask=True, reset_position_ids=True, eod_token=EOD))
    if args.attn == "local":
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    else:
        spec = get_gpt_layer_spec_with_mtraining(
            use_te=False, normalization="RMSNorm",
            mtraining_config=mt_config,
        )
    torch.manual_seed(1234)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ,
                     position_embedding_type=args.position_embedding_type)
    if args.ref_weights:
        model.load_state_dict(torch.load(args.ref_weights), strict=False)
    if args.save_weights and rank == 0:
        torch.save(model.state_dict(), args.save_weights)
    rope_layout = Layout(args.rope_layout or args.layout, cp_size=cp, granularity=args.granularity)
    if plan is not None:
        install_layout_rope(model, plan)
    elif args.attn != "local":
        install_layout_rope(model, rope_layout, cp_group)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)

    toks = text_like_tokens(BATCH, SEQ + 1, VOCAB)
    loss_mask = torch.ones(BATCH, SEQ)
    if args.mask == "uneven":
        # most tokens that the (striped) CP rank 1 holds are masked out; others keep theirs
        pos1 = Layout("striped", cp_size=2, granularity=args.granularity).positions(1, SEQ)
        g = torch.Generator().manual_seed(7)
        drop = torch.rand(BATCH, pos1.numel(), generator=g) < 0.9
        loss_mask[:, pos1] = (~drop).float()
    position_ids = torch.arange(SEQ).expand(BATCH, -1).contiguous()
    doc_mask = None
    if args.packed:
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

        for b, ends in enumerate(EOD_AT):             # documents of 1, odd lengths, straddling stripes
            toks[b, ends] = EOD
        rows = [_get_ltor_masks_and_position_ids(toks[b, :-1], EOD, True, True, True, args.attn == "local")
                for b in range(BATCH)]
        loss_mask = torch.stack([r[1] for r in rows])
        position_ids = torch.stack([r[2] for r in rows])
        if args.attn == "local":
            doc_mask = torch.stack([r[0] for r in rows])          # [b, 1, s, s], True = masked
    batch = {
        "tokens": toks[:, :-1].contiguous(),
        "labels": toks[:, 1:].contiguous(),  # shifted before sharding
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "attention_mask": None,
    }
    batch_layout = Layout(args.batch_layout or args.layout, cp_size=cp, granularity=args.granularity)
    local = get_batch_on_this_cp_rank_striped(batch, plan if plan is not None else batch_layout, cp_rank)
    packed_seq_params = None if args.packed_no_mask else local.pop("packed_seq_params", None)

    # capture layer 1's post-RoPE query/key (the core-attention inputs, [s_local, b, n, hn])
    captured: dict[str, torch.Tensor] = {}

    def grab_qk(_module, hook_args):
        captured["q"], captured["k"] = hook_args[0].detach(), hook_args[1].detach()

    model.module.decoder.layers[0].self_attention.core_attention.register_forward_pre_hook(grab_qk)

    model.zero_grad_buffer()
    # the stock DotProductAttention needs an explicit causal mask on CPU (its default one is built
    # on CUDA); MTrainingAttention gets None, as from GPTDataset(create_attention_mask=False)
    attn_mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None] if args.attn == "local" else None
    if doc_mask is not None:
        attn_mask = doc_mask
    loss_tok = model(local["tokens"], local["position_ids"], attn_mask, labels=local["labels"],
                     packed_seq_params=packed_seq_params)  # [b, s/cp]
    mask = local["loss_mask"]
    local_sum = (loss_tok * mask).sum()
    local_cnt = mask.sum()
    stats = torch.stack([local_sum.detach(), local_cnt])
    dist.all_reduce(stats, group=ps.get_data_parallel_group(with_context_parallel=True))
    (local_sum / stats[1]).backward()
    model.finish_grad_sync()

    # naive objective (mean of per-rank means) only for the uneven-mask sensitivity check
    rank_mean = (local_sum.detach() / local_cnt.clamp(min=1)).reshape(1)
    dist.all_reduce(rank_mean, group=cp_group)
    rank_mean /= cp

    parts = [torch.empty_like(loss_tok) for _ in range(cp)]
    dist.all_gather(parts, loss_tok.detach().contiguous(), group=cp_group)
    loss_tok_global = batch_layout.unshard(parts, dim=1)
    qk = {}
    for name in ("q", "k"):
        qparts = [torch.empty_like(captured[name]) for _ in range(cp)]
        dist.all_gather(qparts, captured[name].contiguous(), group=cp_group)
        qk[name] = batch_layout.unshard(qparts, dim=0)  # [s, b, n, hn] in global token order
    grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    if rank == 0:
        torch.save({
            "loss": (stats[0] / stats[1]).item(), "loss_rank_mean": rank_mean.item(),
            "loss_tok": loss_tok_global, "grads": grads, "grad_norm": grad_norm, "cp": cp,
            "q": qk["q"], "k": qk["k"],
        }, args.out)
        print(f"WORKER_DONE cp={cp} loss={(stats[0] / stats[1]).item():.8f} grad_norm={grad_norm:.8f} "
              f"out={args.out}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
