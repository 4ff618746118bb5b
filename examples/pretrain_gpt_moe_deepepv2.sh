#!/usr/bin/env bash
# GPT-MoE pretraining on mock data with Megatron-LM's own pretrain_gpt.py and the deepepv2 dispatcher.
#
#   examples/pretrain_gpt_moe_deepepv2.sh /path/to/Megatron-LM [NUM_GPUS] [extra pretrain_gpt.py args...]
#
# The Megatron-LM checkout must match the installed megatron-core release (its pretrain_gpt.py, gpt_builders.py,
# model_provider.py and megatron/ are used unchanged; e.g. the core_v0.19.0 tag for megatron-core 0.19.x). The launch
# only prefixes pretrain_gpt.py with `-m megatron_deepepv2.cli.run`, which installs the backend before Megatron parses
# `--moe-flex-dispatcher-backend deepepv2`. Backend: DeepEP's ElasticBuffer when usable, else the portable reference
# backend (MEGATRON_DEEPEPV2_BACKEND).
#
# MODEL picks the MoE (all: local spec (no Transformer Engine), SwiGLU without biases, top-8, BF16):
#   gpt-moe (default)       the example: 8 MoE layers, hidden 1024, 64 experts of FFN 256, sequence 1024, 4 sequences
#                           per GPU and micro-batch (4,096 tokens); softmax router with an auxiliary load-balancing loss.
#                           Its step is host-bound (many small kernels).
#   gpt-moe-large           a step whose GPU time dominates: 4 MoE layers, hidden 2048 (16 heads), 64 experts of
#                           FFN 768, sequence 4096, 4 sequences per micro-batch (16,384 tokens).
#   qwen3-moe-router        Qwen3-MoE's router: 128 experts, top-8, softmax over the selected experts' logits
#                           (normalised top-k), global auxiliary loss 1e-3; 6 MoE layers, hidden 1024, experts of
#                           FFN 384, 4,096 tokens.
#   deepseek-v3-router      DeepSeek-V3's router features: 6 layers, the first dense; sigmoid scores with an expert
#                           bias (aux-loss-free balancing) and the sequence aux loss; group-limited top-k (8 groups,
#                           4 chosen) with a scaling factor; a shared expert (FFN 512) beside 64 routed ones
#                           (hidden 1024, FFN 256, 4,096 tokens).
# SwiGLU, not Megatron's default GELU: the experts scale by the router probability inside the MLP, and megatron-core
# 0.19's fused bias-activation path supports that only for SwiGLU and quick GELU ("Only support fusion of swiglu and
# quick_gelu with per_token_scale in MLP"), with either dispatcher. Biases off: SyncFreeSequentialMLP
# (MEGATRON_DEEPEPV2_EXPERTS=sync_free) has none.
#
# Extra args override the defaults below (e.g. `--train-iters 200`). Variants, by environment or arguments:
#   Megatron's alltoall baseline:  ... --moe-token-dispatcher-type alltoall --moe-flex-dispatcher-backend deepep
#   alltoall at its best:           and --cuda-graph-impl local --cuda-graph-modules moe_router moe_preprocess (the
#                                   widest scope Megatron accepts for it: no graph in a GPT layer, a later host copy)
#   FP8 dispatch:                   MEGATRON_DEEPEPV2_FP8_DISPATCH=1
#   grouped-GEMM experts:           MEGATRON_DEEPEPV2_EXPERTS=sync_free (any dispatcher, alltoall too)
#   no host sync + CUDA graphs:     MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 MEGATRON_DEEPEPV2_EXPERTS=sync_free ... \
#                                   --cuda-graph-impl local
#   determinism:                    ... --deterministic-mode  (megatron-core < 0.19 also needs NCCL_ALGO=Ring)
# RUNNER replaces `-m megatron_deepepv2.cli.run` (e.g. `tools/train_gpt.py record --out run.jsonl --`, which also
# records every step).
set -euo pipefail

MEGATRON_LM=${1:?usage: $0 /path/to/Megatron-LM [NUM_GPUS] [extra args...]}
NUM_GPUS=${2:-1}
shift $(( $# >= 2 ? 2 : 1 ))

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"
RUNNER=${RUNNER:--m megatron_deepepv2.cli.run}
# The shape every model shares unless it sets its own (later arguments win in Megatron's parser).
SHAPE_ARGS=(--hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 --seq-length 1024
  --max-position-embeddings 1024 --num-experts 64 --moe-ffn-hidden-size 256 --micro-batch-size 4)
case "${MODEL:-gpt-moe}" in
  gpt-moe) MODEL_ARGS=(--num-layers 8 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2) ;;
  gpt-moe-large) MODEL_ARGS=(--num-layers 4 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
      --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 4096
      --max-position-embeddings 4096 --moe-ffn-hidden-size 768) ;;
  qwen3-moe-router) MODEL_ARGS=(--num-layers 6 --num-experts 128 --moe-ffn-hidden-size 384
      --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3) ;;
  deepseek-v3-router) MODEL_ARGS=(--num-layers 6 --moe-layer-freq "([0]*1+[1]*5)"
      --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
      --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
      --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5
      --moe-shared-expert-intermediate-size 512) ;;
  *) echo "MODEL=$MODEL: use gpt-moe, gpt-moe-large, qwen3-moe-router or deepseek-v3-router" >&2; exit 2 ;;
esac

# shellcheck disable=SC2086  # RUNNER is a command line
exec torchrun --nproc-per-node "$NUM_GPUS" --master-port "${MASTER_PORT:-29500}" $RUNNER "$MEGATRON_LM/pretrain_gpt.py" \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
    --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion \
    --no-rope-fusion --no-bias-swiglu-fusion \
    "${SHAPE_ARGS[@]}" "${MODEL_ARGS[@]}" --position-embedding-type rope \
    --swiglu --disable-bias-linear \
    --moe-router-topk 8 --moe-router-dtype fp32 \
    --expert-model-parallel-size "$NUM_GPUS" \
    --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepepv2 \
    --global-batch-size $(( 4 * NUM_GPUS )) --train-iters 50 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.01 --clip-grad 1.0 \
    --bf16 --seed 1234 --log-interval 10 --eval-iters 0 --eval-interval 100000 \
    "$@"
