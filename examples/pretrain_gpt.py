#!/usr/bin/env python
"""GPT pretraining on megatron-core with the MTraining context-parallel attention.

The command line of :mod:`megatron_mtraining.training` (Megatron-LM flag names, see
:mod:`megatron_mtraining.megatron.args`; ``--help`` lists them)::

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention \\
        --num-query-groups 2 --seq-length 4096 --position-embedding-type rope --normalization RMSNorm \\
        --swiglu --context-parallel-size 2 --micro-batch-size 1 --global-batch-size 2 \\
        --train-iters 40 --lr 1e-3 --data-path DATA_PREFIX --tokenizer-model tok.model --save ckpt

Arguments are validated before anything starts (exit status 2, message naming the flag); then
``torch.distributed`` (gloo on CPU, nccl on GPU; torchrun env), the model (``--cp-attention
mtraining``: every CP rank holds the tokens ``Layout(striped).positions(cp_rank, S)`` of each
sample, RoPE on the same positions, ring attention over the CP group), the loop with the exact
global per-token loss, and ``dist_checkpointing`` checkpoints (``--save`` / ``--load``).
Requires the package installed (``make setup``: ``pip install -e .``) or the checkout on ``PYTHONPATH``.
"""

import sys

from megatron_mtraining.training import main

if __name__ == "__main__":
    sys.exit(main())
