#!/usr/bin/env bash
# Small GPT-MoE pretraining on mock data with Megatron-LM's own pretrain_gpt.py and the deepepv2 dispatcher.
#
#   examples/pretrain_gpt_moe_deepepv2.sh /path/to/Megatron-LM [NUM_GPUS] [extra pretrain_gpt.py args...]
#
# The Megatron-LM checkout must match the installed megatron-core release (its pretrain_gpt.py, gpt_builders.py
# and model_provider.py are used unchanged). The script only prefixes the launch with `-m megatron_deepepv2.run`,
# which installs the backend before Megatron parses `--moe-flex-dispatcher-backend deepepv2`.
# Backend: DeepEP's ElasticBuffer when usable, else the portable reference backend (MEGATRON_DEEPEPV2_BACKEND).
# Extra args override the defaults below (e.g. `--train-iters 200`). For an alltoall baseline pass
# `--moe-token-dispatcher-type alltoall --moe-flex-dispatcher-backend deepep` (deepepv2 requires the flex dispatcher).
set -euo pipefail

MEGATRON_LM=${1:?usage: $0 /path/to/Megatron-LM [NUM_GPUS] [extra args...]}
NUM_GPUS=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))

export EP_DISABLE_GIN=${EP_DISABLE_GIN:-1}            # single node without an RDMA NIC
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"

exec torchrun --nproc-per-node "$NUM_GPUS" -m megatron_deepepv2.run "$MEGATRON_LM/pretrain_gpt.py" \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
    --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion \
    --no-bias-gelu-fusion --no-bias-swiglu-fusion \
    --num-layers 2 --hidden-size 1024 --ffn-hidden-size 2048 --num-attention-heads 8 \
    --seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024 --moe-router-dtype fp32 \
    --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size "$NUM_GPUS" \
    --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepepv2 \
    --micro-batch-size 2 --global-batch-size $(( 4 * NUM_GPUS )) --train-iters 50 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.01 --clip-grad 1.0 \
    --bf16 --seed 1234 --log-interval 5 --eval-iters 0 --eval-interval 1000 \
    "$@"
