"""The expert-id check of direct dispatches: every id in ``[-1, num_experts)``, no expert twice in a token's row.

Three forms, one rule, and :func:`routing_ids_problem` picks the form the settings ask for (``check_ids``,
``validate``, ``host_sync``): :func:`expert_ids_problem` reads the ids on the host (numpy for host tensors);
:func:`expert_ids_flag_problem` runs one Triton kernel that clears a 4-byte flag and reads the flag (a dispatch with
host sync waits on the host anyway); :func:`assert_expert_ids_on_device` asserts on that flag on the device, reading
nothing (without host sync; capturable in a CUDA graph). Megatron layers skip the check: their ids come from
``torch.topk``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from megatron_deepepv2.kernels import tl, triton
from megatron_deepepv2.failures import announce_failure

if TYPE_CHECKING:
    from megatron_deepepv2.config import DeepepV2Settings
    from megatron_deepepv2.groups import GroupState


def routing_ids_problem(topk_idx: torch.Tensor, num_experts: int, settings: "DeepepV2Settings",
                        state: "GroupState") -> Optional[Exception]:
    """The id check of one dispatch, in the form ``settings`` allow: with ``validate`` read on the host; else with
    ``check_ids``: without host sync asserted on the device (nothing read), with host sync on a CUDA tensor through a
    4-byte flag, on a host tensor directly.

    Args:
        topk_idx: ``[T, K]`` int64 global expert ids, checked static properties.
        num_experts: Global number of experts.
        settings: The dispatch's settings.
        state: The state of the dispatch's group (a device assert's error is announced to it off CUDA).

    Returns:
        A ``ValueError`` naming the first bad token, or None (also when the check is off, or asserted on the device).
    """
    if settings.validate:
        return expert_ids_problem(topk_idx, num_experts)
    if not settings.check_ids:
        return None
    if not settings.host_sync:  # nothing may read the device: a device-side assert
        assert_expert_ids_on_device(topk_idx, num_experts, state)
        return None
    if topk_idx.is_cuda:  # the dispatch waits on the host anyway: one 4-byte read, a ValueError naming the token
        return expert_ids_flag_problem(topk_idx, num_experts)
    return expert_ids_problem(topk_idx, num_experts)


def expert_ids_problem(topk_idx: torch.Tensor, num_experts: int) -> Optional[Exception]:
    """Checks ``[T, K]`` int64 expert ids on the host (a device-to-host copy for device tensors): each in
    ``[-1, num_experts)``, no expert twice in one row. Returns a ``ValueError`` naming the first bad token, or None."""
    if topk_idx.numel() == 0:
        return None
    if not topk_idx.is_cuda and _host_ids_are_good(topk_idx.numpy(), num_experts):
        return None
    out_of_range, duplicate = _bad_id_masks(topk_idx, num_experts)
    if bool(out_of_range.any()):
        token = int(out_of_range.any(dim=1).nonzero()[0, 0])
        return ValueError(f"topk_idx holds expert ids outside [-1, {num_experts}): token {token} has "
                          f"{topk_idx[token].tolist()}. Use -1 for 'no expert'.")
    if bool(duplicate.any()):
        token = int(duplicate.any(dim=1).nonzero()[0, 0])
        return ValueError(f"topk_idx selects the same expert twice for token {token}: {topk_idx[token].tolist()}. "
                          "Each token must select distinct experts.")
    return None


def _host_ids_are_good(ids: np.ndarray, num_experts: int) -> bool:
    """Whether host ids ``[T, K]`` are all in ``[-1, num_experts)`` with no expert twice in a row: the fast path of
    :func:`expert_ids_problem`, in numpy over the tensor's memory (fewer, cheaper operations than torch's)."""
    if ids.min() < -1 or ids.max() >= num_experts:
        return False
    if ids.shape[1] < 2:
        return True
    ordered = np.sort(ids, axis=1)
    repeats = ordered[:, 1:] == ordered[:, :-1]
    if not repeats.any():
        return True
    # -1 ("no expert") may fill several slots of a row; a repeat of any other id is a duplicate.
    return not (repeats & (ordered[:, 1:] >= 0)).any()


def _bad_id_masks(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, K]`` ids outside ``[-1, num_experts)`` and ``[T, K-1]`` repeats of an expert in a row (tensor ops)."""
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    ordered = torch.sort(topk_idx, dim=1).values
    duplicate = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    return out_of_range, duplicate


def _any_bad_id(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """0-dim bool: whether ``topk_idx`` holds a bad id, computed on its device without a host read."""
    out_of_range, duplicate = _bad_id_masks(topk_idx, num_experts)
    return out_of_range.any() | duplicate.any()


_BAD_IDS_MESSAGE = ("deepepv2 dispatch: topk_idx holds an expert id outside [-1, num_experts) or a token that selects "
                    "one expert twice. Rerun with MEGATRON_DEEPEPV2_VALIDATE=1 to raise a ValueError naming the token "
                    "and its ids.")
#: Per CUDA device: the int32 flag of the device-side assert (never reset: a failed assert stops the process).
_ok_flags: dict[torch.device, torch.Tensor] = {}
#: Per CUDA device: the flag of :func:`expert_ids_flag_problem`, read on the host (and reset after a failure).
_host_read_flags: dict[torch.device, torch.Tensor] = {}


def _flag_on(flags: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The int32 flag of ``flags`` on ``device``, set to 1 when first made (no allocation after that)."""
    flag = flags.get(device)
    if flag is None:
        flag = flags.setdefault(device, torch.ones(1, dtype=torch.int32, device=device))
    return flag


if triton is not None:

    @triton.jit
    def _check_expert_ids_kernel(idx_ptr, ok_ptr, num_tokens, num_experts, K: tl.constexpr, K_PAD: tl.constexpr,
                                 BLOCK_T: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, K_PAD)
        in_rows = rows < num_tokens
        mask = in_rows[:, None] & (cols[None, :] < K)
        ids = tl.load(idx_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=-1)
        bad = mask & ((ids < -1) | (ids >= num_experts))
        for j in tl.static_range(K - 1):  # id j against the ids after it
            id_j = tl.load(idx_ptr + rows * K + j, mask=in_rows, other=-1)
            later = mask & (cols[None, :] > j)
            bad = bad | (later & (ids == id_j[:, None]) & (id_j[:, None] >= 0))
        num_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
        tl.atomic_min(ok_ptr, tl.where(num_bad > 0, 0, 1))


def clear_flag_on_bad_ids(topk_idx: torch.Tensor, num_experts: int, ok: torch.Tensor) -> None:
    """Sets the int32 ``ok`` (on ``topk_idx``'s device) to 0 when the contiguous ``[T, K]`` ``topk_idx`` holds an id
    outside ``[-1, num_experts)`` or an expert twice in a row; leaves it as it is otherwise. Reads nothing back."""
    num_tokens, num_topk = topk_idx.shape
    if triton is not None and topk_idx.is_cuda:
        k_pad = triton.next_power_of_2(num_topk)
        block_t = max(16, 2048 // k_pad)
        _check_expert_ids_kernel[(triton.cdiv(num_tokens, block_t),)](
            topk_idx, ok, num_tokens, num_experts, K=num_topk, K_PAD=k_pad, BLOCK_T=block_t)
    else:  # pragma: no cover - CUDA builds of PyTorch ship Triton
        ok.mul_((~_any_bad_id(topk_idx, num_experts)).to(torch.int32))


def expert_ids_flag_problem(topk_idx: torch.Tensor, num_experts: int) -> Optional[Exception]:
    """The id check of a CUDA dispatch with host sync: :func:`clear_flag_on_bad_ids`, then one read of its 4-byte flag
    (the ids are copied to the host only when one is bad). Unlike a device assert, a bad id leaves the process usable.

    Returns:
        A ``ValueError`` naming the first bad token, or None.
    """
    if topk_idx.shape[0] == 0:
        return None
    flag = _flag_on(_host_read_flags, topk_idx.device)
    clear_flag_on_bad_ids(topk_idx.contiguous(), num_experts, flag)
    if flag.item():  # waits for the queued work, as the dispatch's own host wait would moments later
        return None
    flag.fill_(1)
    return expert_ids_problem(topk_idx.cpu(), num_experts) or ValueError(_BAD_IDS_MESSAGE)


def assert_expert_ids_on_device(topk_idx: torch.Tensor, num_experts: int,
                                state: Optional["GroupState"] = None) -> None:
    """The id check without a host read. On CUDA, :func:`clear_flag_on_bad_ids` and ``torch._assert_async`` on its
    flag: nothing allocated or awaited (capturable in a CUDA graph); a bad id stops the process, the message saying to
    rerun with ``MEGATRON_DEEPEPV2_VALIDATE=1`` to name the token.

    Raises:
        RuntimeError: Off CUDA, for a bad id (first announced to the peers of the group of ``state`` when given).
    """
    num_tokens, num_topk = topk_idx.shape
    if num_tokens == 0:
        return
    if not topk_idx.is_cuda:
        try:
            torch._assert_async(~_any_bad_id(topk_idx, num_experts), _BAD_IDS_MESSAGE)
        except RuntimeError as error:
            if state is not None:
                announce_failure(state, error)
            raise
        return
    ok = _flag_on(_ok_flags, topk_idx.device)
    clear_flag_on_bad_ids(topk_idx, num_experts, ok)
    torch._assert_async(ok, _BAD_IDS_MESSAGE)
