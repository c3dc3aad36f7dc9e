"""Torch kernels of the wire format in ``docs/design/design.md``: bucket norms, unbiased stochastic
rounding, b-bit packing, and the decode-and-sum of payloads, on the tensor's own device.

Plain vectorized torch ops; the compiled CPU codec (:mod:`horovod_alq.torch.codecs.cpu_build`)
replaces the CPU hot path with a compiled kernel where one builds.
"""

from __future__ import annotations

import torch

from ...core.wire import HEADER_SIZE

_SHIFTS: dict[tuple[int, str], torch.Tensor] = {}


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    key = (bits, str(device))
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(8, device=device, dtype=torch.int64) * bits
    return _SHIFTS[key]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision the codec computes in: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bucket_view(flat: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Zero-pad a 1-D tensor to whole buckets and view it as ``(num_buckets, bucket_size)``."""
    n = flat.numel()
    nb = -(-n // bucket_size)
    pad = nb * bucket_size - n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(nb, bucket_size)


def row_max_abs(rows: torch.Tensor) -> torch.Tensor:
    """``rows.abs().amax(dim=1)``, exactly, as ``max(max x, -min x)``: amax and amin reduce in place,
    where abs() writes a copy first (20x slower on CPU)."""
    return torch.maximum(rows.amax(dim=1), -rows.amin(dim=1))


def bucket_norms(buckets: torch.Tensor, norm: str) -> torch.Tensor:
    """float32 norm per bucket (``"l2"`` or ``"linf"``); NaN where a value is not finite."""
    if norm == "l2":
        norms = torch.linalg.vector_norm(buckets, dim=1)
    else:
        norms = row_max_abs(buckets)
    norms = norms.float()
    finite = torch.isfinite(buckets).all(dim=1)
    return norms.masked_fill_(~finite, float("nan"))


def normalize(buckets: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``r = x / n`` per bucket with the float32 norm, clipped to [-1, 1]; 0 where ``n`` is 0 or NaN."""
    ok = torch.isfinite(norms) & (norms > 0)
    denom = torch.where(ok, norms, torch.ones_like(norms)).to(buckets.dtype)
    r = (buckets / denom[:, None]).clamp_(-1.0, 1.0)
    return r.masked_fill_(~ok[:, None], 0.0)


def stochastic_codes(r: torch.Tensor, levels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Unbiased stochastic rounding of ``r`` (values in [-1, 1]) to uint8 indices into ``levels``.

    For ``levels[j] <= r <= levels[j+1]`` the code is ``j + 1`` with probability
    ``(r - levels[j]) / (levels[j+1] - levels[j])``, else ``j``.
    """
    levels = levels.to(device=r.device, dtype=r.dtype)
    cell = torch.bucketize(r, levels[1:-1], right=True)
    lo = levels[cell]
    prob = (r - lo) / (levels[cell + 1] - lo)
    u = torch.rand(r.shape, generator=generator, device=r.device, dtype=r.dtype)
    return (cell + (u < prob)).to(torch.uint8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2**bits) into ``ceil(n * bits / 8)`` bytes, LSB-first bit stream."""
    n = codes.numel()
    groups = -(-n // 8)
    flat = codes.reshape(-1)
    if groups * 8 != n:
        flat = torch.nn.functional.pad(flat, (0, groups * 8 - n))
    words = (flat.view(groups, 8).to(torch.int64) << _shifts(bits, codes.device)).sum(dim=1)
    packed = words.view(torch.uint8).view(groups, 8)[:, :bits]
    return packed.reshape(-1)[: -(-n * bits // 8)]


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int64 codes of length ``n``."""
    groups = -(-n // 8)
    full = torch.zeros(groups * bits, dtype=torch.uint8, device=packed.device)
    full[: packed.numel()] = packed
    buf = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    buf[:, :bits] = full.view(groups, bits)
    words = buf.view(torch.int64).view(groups)
    codes = (words[:, None] >> _shifts(bits, packed.device)) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n]


def encode(
    tensor: torch.Tensor,
    levels: torch.Tensor,
    header: torch.Tensor,
    *,
    bits: int,
    bucket_size: int,
    norm: str,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Encode a float tensor into one payload: ``header | float32 norms | packed codes`` (uint8)."""
    flat = tensor.detach().reshape(-1).to(work_dtype(tensor.dtype))
    buckets = bucket_view(flat, bucket_size)
    norms = bucket_norms(buckets, norm)
    codes = stochastic_codes(normalize(buckets, norms), levels, generator)
    packed = pack_codes(codes.reshape(-1)[: flat.numel()], bits)
    return torch.cat([header.to(tensor.device), norms.view(torch.uint8), packed])


def decode_into(
    out: torch.Tensor, payload: torch.Tensor, levels: torch.Tensor, *, bits: int, bucket_size: int
) -> torch.Tensor:
    """Add the decoded values of one (already validated) payload to the float32 tensor ``out``."""
    n = out.numel()
    nb = -(-n // bucket_size)
    norms = payload[HEADER_SIZE : HEADER_SIZE + 4 * nb].clone().view(torch.float32)  # clone: align
    start = HEADER_SIZE + 4 * nb
    codes = unpack_codes(payload[start : start + -(-n * bits // 8)], bits, n)
    table = torch.full((1 << bits,), float("nan"), dtype=torch.float32, device=out.device)
    table[: levels.numel()] = levels.to(device=out.device, dtype=torch.float32)  # extra codes: NaN
    values = table[codes]
    values = bucket_view(values, bucket_size).mul_(norms[:, None]).view(-1)[:n]
    return out.add_(values)


def _normalized(tensor: torch.Tensor, bucket_size: int, norm: str):
    flat = tensor.detach().reshape(-1).to(work_dtype(tensor.dtype))
    buckets = bucket_view(flat, bucket_size)
    norms = bucket_norms(buckets, norm)
    counts = torch.full((buckets.shape[0],), float(bucket_size), dtype=torch.float64, device=flat.device)
    if buckets.shape[0]:
        counts[-1] = flat.numel() - (buckets.shape[0] - 1) * bucket_size
    keep = torch.isfinite(norms) & (norms > 0)
    return normalize(buckets, norms).double(), norms.double(), counts, keep


def bucket_moments(tensor: torch.Tensor, *, bucket_size: int, norm: str):
    """Per-bucket ``(norms, count, sum_r, sum_r2)`` as float64 NumPy arrays over finite buckets with
    a non-zero norm: the input of :func:`horovod_alq.core.statistics.normless_statistics`."""
    r, norms, counts, keep = _normalized(tensor, bucket_size, norm)
    out = (norms, counts, r.sum(dim=1), (r * r).sum(dim=1))
    return tuple(t[keep].cpu().numpy() for t in out)


def grid_statistics(tensor: torch.Tensor, grid: torch.Tensor, *, bucket_size: int, norm: str):
    """Norm-based statistics vector ``[W, C(grid)]`` (float64 NumPy), computed on the tensor's
    device as :func:`horovod_alq.core.statistics.grid_statistics` defines it."""
    return _grid_cumulative(tensor, grid, bucket_size, norm, squared=False)[0]


def grid_histograms(tensor: torch.Tensor, grid: torch.Tensor, *, bucket_size: int, norm: str):
    """:func:`grid_statistics` and the same counts weighted by ``n_b**2`` (shape (2, 1 + G), float64
    NumPy), as :func:`horovod_alq.core.statistics.grid_histograms` defines them."""
    return _grid_cumulative(tensor, grid, bucket_size, norm, squared=True)


def _grid_cumulative(tensor, grid, bucket_size, norm, squared):
    r, norms, counts, keep = _normalized(tensor, bucket_size, norm)
    n = tensor.numel()
    cells = torch.bucketize(r.reshape(-1)[:n], grid.to(r.device), right=False).clamp_(min=1)
    bucket_weights = [torch.where(keep, norms / counts, torch.zeros_like(norms))]
    if squared:
        bucket_weights.append(torch.where(keep, norms * norms, torch.zeros_like(norms)))
    out = torch.empty(len(bucket_weights), grid.numel() + 1, dtype=torch.float64, device=r.device)
    for row, weights in zip(out, bucket_weights):
        hist = torch.zeros(grid.numel() + 1, dtype=torch.float64, device=r.device)
        hist.index_add_(0, cells, weights[:, None].expand_as(r).reshape(-1)[:n])
        row[0] = (weights * counts).sum()
        row[1:] = hist[: grid.numel()].cumsum(0)
    return out.cpu().numpy()
