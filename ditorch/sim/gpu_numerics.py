"""``DITORCH_SIM_NUMERICS=gpu``: sim sums, and splits long GEMMs, as a GPU's kernels do: in another order than the CPU.

A GPU's result of a sum legitimately differs from the CPU's: its kernels add the same terms in another order. On an
NVIDIA H200 that difference made OpAutoCompare fail a clean float32 Llama (issue 34): the gradient of RMSNorm's
``(..., 1)`` factor, a sum over 512 products, erred ~46 float32 eps where the CPU's sum erred ~10. sim runs the CPU's
kernels, so by default it is bit-identical to the CPU and such a difference never shows in CI; in this mode it does.

Which ops: the GEMMs ``mm``, ``bmm``, ``addmm`` and ``baddbmm`` of float32 and half types (what ``linear`` and
``matmul`` reach the device as, forward and backward) with an inner dimension of more than 256: split along it into
at most 16 slices, each slice's product computed in float32 (with TF32 operands where that switch is on) and the
slices' products added in order (split-K); and ``sum`` and ``mean`` of floating tensors, over some dimensions or all
(``sum.dim_IntList``,
``sum.default``, ``mean.dim``, ``mean.default``): what the gradients of broadcasting ops (``sum_to_size``), bias
gradients, norms' statistics and losses reach the device as. In the order of CUDA's reduction kernels:

- over the innermost dimensions (contiguous terms): a warp of 32 threads, each loading 4 consecutive terms at a time
  into 4 accumulators (term ``i`` to accumulator ``i % 128``), each accumulator adding its terms in order, each
  thread its 4 accumulators, then the threads' sums added pairwise, neighbours first (the warp's shuffle tree);
- over outer dimensions (terms strided in memory): one thread per result, adding its terms in order (CUDA's
  configuration for such reductions, and a bias gradient's);
- more than 1024 terms per accumulator are split into blocks so reduced, whose sums are added pairwise;
- accumulated in float32 for float16 and bfloat16 (``acc_type``), in the tensor's own dtype otherwise, and a mean
  multiplies the sum by ``1/n`` rounded to the accumulation type (CUDA's ``MeanOps``), rather than dividing.

And ``_log_softmax`` in CUDA's association, ``x - (max + log(sum))``, where the CPU's is ``(x - max) - log(sum)``
(rounded to a half type, an ulp apart in some elements); ``softmax``, ``_safe_softmax`` (attention's) and both
softmaxes' backward with their row sums in a warp's order (a lane per 32nd term, the lanes' sums pairwise);
``embedding_dense_backward`` summing each index's rows in CUDA's chunks of ``ROWS_PER_THREAD``. And
``addcmul`` and ``addcdiv`` (in place too: Adam's moments, when not through ``_foreach``) with a fused multiply-add,
as nvcc contracts CUDA's ``self + alpha * t1 * t2`` and ``self + alpha * (t1 / t2)``: the last product is not rounded
before the addition. (``add``'s ``alpha`` is fused on the CPU too: torch 2.13's ``add(a, b, alpha=0.3)`` in float32
equals ``fma(0.3, b, a)`` on 100,000 random elements.) Subnormals are kept, as in
PyTorch's CUDA kernels, which are built without fast math (flash attention's exponentials flush below 2^-126, where a
probability weighs less than any rounding).

Off by default. ``ditorch.sim.numerics("gpu")`` switches it for a block; ``torch.sim.numerics()`` says which is on.
"""

from __future__ import annotations

import threading

import torch

from .kernels import KERNELS, accumulate_dtype, overload

ENV_VAR = "DITORCH_SIM_NUMERICS"
FORM = "cpu or gpu"
MODES = ("cpu", "gpu")
WARP = 32  # threads a reduction over contiguous terms is dealt to
VECTOR = 4  # consecutive terms a thread loads at once, into as many accumulators
MAX_PER_LANE = 1024  # terms one accumulator adds before the reduction is split into blocks
_OPS = ("sum.dim_IntList", "sum.default", "mean.dim", "mean.default")


def parse_mode(text: str) -> str:
    """``DITORCH_SIM_NUMERICS``' value; ValueError if it is neither ``cpu`` nor ``gpu``."""
    mode = text.strip() or "cpu"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={text!r}: expected {FORM}")
    return mode


def ordered_sum(rows: torch.Tensor, lanes: int, vector: int = 1) -> torch.Tensor:
    """``(M, n) -> (M,)``: each row's sum in the order of a CUDA reduction, in ``rows``' dtype (the accumulation
    type). ``lanes`` threads each keep ``vector`` accumulators (loads of ``vector`` consecutive terms): term ``i`` goes
    to accumulator ``i % (lanes * vector)``, which adds its terms in order; each thread adds its accumulators in order,
    then the threads' sums are added pairwise, neighbours first (a warp's shuffle tree). A row of more than
    ``MAX_PER_LANE`` terms per accumulator is split into blocks reduced so, whose sums are added pairwise."""
    m, n = rows.shape
    if n == 0:
        return rows.new_zeros(m)
    per_block = lanes * vector * MAX_PER_LANE
    if n <= per_block:
        return _block_sum(rows, lanes, vector)
    blocks = -(-n // per_block)
    rows = torch.nn.functional.pad(rows, (0, blocks * per_block - n))  # zeros: adding them changes no sum
    return _pairwise(_block_sum(rows.reshape(m * blocks, per_block), lanes, vector).view(m, blocks))


def _block_sum(rows: torch.Tensor, lanes: int, vector: int) -> torch.Tensor:
    m, n = rows.shape
    slots = lanes * vector
    if n % slots:
        rows = torch.nn.functional.pad(rows, (0, slots - n % slots))
    dealt = rows.reshape(m, -1, slots)
    accumulators = dealt[:, 0, :].clone()
    for j in range(1, dealt.shape[1]):
        accumulators += dealt[:, j, :]
    per_thread = accumulators.view(m, lanes, vector)
    threads = per_thread[..., 0].clone()
    for k in range(1, vector):
        threads += per_thread[..., k]
    return _pairwise(threads)


def _pairwise(partial: torch.Tensor) -> torch.Tensor:
    while partial.shape[1] > 1:
        if partial.shape[1] % 2:
            partial = torch.nn.functional.pad(partial, (0, 1))
        partial = partial[:, 0::2] + partial[:, 1::2]
    return partial[:, 0]


def _reduce(x: torch.Tensor, dim, keepdim: bool, dtype, mean: bool) -> torch.Tensor | None:
    """The sum (or mean) in a GPU's order; None for what this mode leaves to the CPU's kernel (integers, complex)."""
    if not x.is_floating_point() or (dtype is not None and not dtype.is_floating_point):
        return None
    out_dtype = dtype or x.dtype
    acc = accumulate_dtype(out_dtype)
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    if x.dim() == 0:
        dims = []
    kept = [d for d in range(x.dim()) if d not in dims]
    n = 1
    for d in dims:
        n *= x.shape[d]
    innermost = dims == list(range(x.dim() - len(dims), x.dim()))
    rows = x.permute([*kept, *dims]).reshape(-1, n).to(acc)  # a list: a 0-d tensor has no dims to name
    total = ordered_sum(rows, WARP, VECTOR) if innermost else ordered_sum(rows, 1)
    if mean:
        total = total * torch.tensor(1.0 / n if n else float("nan"), dtype=acc)
    shape = [1 if d in dims else x.shape[d] for d in range(x.dim())] if keepdim else [x.shape[d] for d in kept]
    return total.reshape(shape).to(out_dtype)


def _kernel(op, mean: bool, with_dim: bool):
    def kernel(x, *args, **kwargs):
        if with_dim:
            dim = args[0] if args else kwargs.get("dim")
            keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
        else:
            dim, keepdim = None, False
        result = _reduce(x, dim, keepdim, kwargs.get("dtype"), mean)
        return op(x, *args, **kwargs) if result is None else result

    return kernel


K_SLICE = 256  # a GEMM's inner dimension beyond this is split (split-K): each slice's product in float32, in order
MAX_SLICES = 16
_GEMMS = {"mm": None, "bmm": None, "addmm": "mm", "baddbmm": "bmm"}  # op -> the product of its two factors


def _split_k(op, name: str):
    """``op`` with its inner dimension split into slices whose float32 products are added in order, as a GPU's
    split-K GEMM does; the slices' products by the kernel the op had before (TF32 rounding, where on, included)."""
    product_name = _GEMMS[name] or name
    product = KERNELS.get(overload(product_name), overload(product_name))
    plain = KERNELS.get(op, op)
    accumulate = _GEMMS[name] is not None

    def kernel(*args, **kwargs):
        a, b = (args[1], args[2]) if accumulate else (args[0], args[1])
        k = a.shape[-1]
        if len(args) != (3 if accumulate else 2) or not a.is_floating_point() or a.dtype == torch.float64 \
                or k <= K_SLICE:
            return plain(*args, **kwargs)
        slices = min(MAX_SLICES, -(-k // K_SLICE))
        bounds = [k * i // slices for i in range(slices + 1)]
        total = None
        for start, stop in zip(bounds, bounds[1:]):
            part = product(a[..., start:stop].float(), b[..., start:stop, :].float())
            total = part if total is None else total.add_(part)
        assert total is not None
        if accumulate:
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            total = total * alpha if alpha != 1 else total
            total = total + args[0].float() * beta if beta != 0 else total
        return total.to(a.dtype)

    return kernel


_FUSED_MULTIPLY_ADDS = ("addcmul.default", "addcmul_.default", "addcdiv.default", "addcdiv_.default")


def _fused_multiply_add(op, name: str):
    """``addcmul``/``addcdiv`` as CUDA computes them: ``fma(alpha * t1, t2, self)`` and ``fma(alpha, t1 / t2, self)``
    in the accumulation type, rounded once at the end (the exact product and sum in float64, then rounded)."""
    divide, in_place = name.startswith("addcdiv"), "_." in name
    plain = KERNELS.get(op, op)

    def kernel(self, tensor1, tensor2, *, value=1):
        if not self.is_floating_point() or self.dtype == torch.float64 or self.is_complex():
            return plain(self, tensor1, tensor2, value=value)
        acc = accumulate_dtype(self.dtype)
        if divide:
            factor, other = torch.tensor(value, dtype=acc), tensor1.to(acc) / tensor2.to(acc)
        else:
            factor, other = tensor1.to(acc) * value, tensor2.to(acc)
        result = (self.double() + factor.double() * other.double()).to(acc).to(self.dtype)
        return self.copy_(result) if in_place else result

    return kernel


def _sum_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim, keepdim=True)`` in the order of CUDA's softmax kernels: a row's terms dealt to a warp's 32 lanes
    (term ``i`` to lane ``i % 32``), each lane adding its own in order, the lanes' sums added pairwise (a warp's
    shuffle reduction; the CPU adds vectors of 8 or 16 and then across them)."""
    moved = x.movedim(dim, -1)
    total = ordered_sum(moved.reshape(-1, moved.shape[-1]), WARP)
    return total.reshape(moved.shape[:-1]).unsqueeze(-1).movedim(-1, dim)


_LOG_SOFTMAX = ("_log_softmax.default",)


def _log_softmax(op, name: str):
    """``_log_softmax`` as CUDA's kernel computes it (``LogSoftMaxForwardEpilogue``): ``x - (max + log(sum))`` in the
    accumulation type, the sum in a warp's order, where the CPU's computes ``(x - max) - log(sum)``. Rounded to a
    half type, the two differ by an ulp in some elements: on an H200, ``cross_entropy`` of float16 logits under
    autocast (its ``log_softmax`` in float16) erred 5.6 times the CPU's own error on the same call, a legitimate
    difference."""
    plain = KERNELS.get(op, op)

    def kernel(self, dim, half_to_float):
        if not self.is_floating_point() or self.dtype == torch.float64:
            return plain(self, dim, half_to_float)
        acc = accumulate_dtype(self.dtype)
        x = self.to(acc)
        top = x.amax(dim, keepdim=True)
        total = _sum_along((x - top).exp(), dim)
        out = x - (top + total.log())
        return out if half_to_float else out.to(self.dtype)

    return kernel


_SOFTMAXES = ("_softmax.default", "_safe_softmax.default", "_softmax_backward_data.default",
              "_log_softmax_backward_data.default")


def _softmax(op, name: str):
    """``softmax`` (and ``_safe_softmax``: a row of -inf gives zeros) and the two softmaxes' backward as CUDA computes
    them, their row sums in a warp's order (``_sum_along``) in the accumulation type: ``exp(x - max) / sum``;
    ``out * (grad - sum(grad * out))``; ``grad - exp(out) * sum(grad)``."""
    plain = KERNELS.get(op, op)
    safe, backward, log = name.startswith("_safe"), "backward" in name, name.startswith("_log")

    def kernel(*args, **kwargs):
        if backward:
            if kwargs or len(args) != 4 or not args[0].is_floating_point() or args[0].dtype == torch.float64:
                return plain(*args, **kwargs)
            grad, out, dim, input_dtype = args
            acc = accumulate_dtype(grad.dtype)
            g, o = grad.to(acc), out.to(acc)
            result = g - o.exp() * _sum_along(g, dim) if log else o * (g - _sum_along(g * o, dim))
            return result.to(input_dtype)
        x, dim = args[0], args[1]
        last = args[2] if len(args) > 2 else kwargs.get("dtype" if safe else "half_to_float")
        out_dtype = (last or x.dtype) if safe else torch.float32 if last else x.dtype
        if not x.is_floating_point() or torch.float64 in (x.dtype, out_dtype):
            return plain(*args, **kwargs)
        acc = accumulate_dtype(x.dtype)
        v = x.to(acc)
        top = v.amax(dim, keepdim=True)
        if safe:
            top = torch.where(torch.isinf(top) & (top < 0), torch.zeros_like(top), top)
        e = (v - top).exp()
        total = _sum_along(e, dim)
        out = e / total
        if safe:
            out = torch.where(total == 0, torch.zeros_like(out), out)
        return out.to(out_dtype)

    return kernel


_EMBEDDING_BACKWARD = ("embedding_dense_backward.default",)
ROWS_PER_THREAD = 10  # a CUDA embedding backward's partial segment: the rows of one index one thread sums in order


def _embedding_backward(op, name: str):
    """``embedding_dense_backward`` as CUDA's kernel sums it: the positions sorted by index (stably), each index's
    rows summed in order in chunks of ``ROWS_PER_THREAD`` (a thread each, in the accumulation type), then each
    index's chunk sums added in order; the CPU adds every row into its index's in one pass. A row of ``padding_idx``
    stays zero; ``scale_grad_by_freq`` is left to the CPU's kernel."""
    plain = KERNELS.get(op, op)

    def kernel(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
        if scale_grad_by_freq or not grad_output.is_floating_point() or grad_output.dtype == torch.float64 or \
                indices.numel() == 0:
            return plain(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
        acc = accumulate_dtype(grad_output.dtype)
        rows = grad_output.reshape(indices.numel(), -1).to(acc)
        flat = indices.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        ordered = flat[order]
        positions = torch.arange(len(flat))
        starts = torch.ones(len(flat), dtype=torch.bool)
        starts[1:] = ordered[1:] != ordered[:-1]
        rank = positions - torch.cummax(torch.where(starts, positions, 0), 0).values  # among its index's rows
        group = torch.cumsum(starts, 0) - 1
        chunks = int(rank.max()) // ROWS_PER_THREAD + 1
        key = group * chunks + rank // ROWS_PER_THREAD
        partial = rows.new_zeros(int(group[-1]) + 1, chunks, rows.shape[1])
        flat_partial = partial.view(-1, rows.shape[1])
        for lane in range(ROWS_PER_THREAD):  # each chunk one row per lane: added in order
            chosen = rank % ROWS_PER_THREAD == lane
            flat_partial.index_add_(0, key[chosen], rows[order[chosen]])
        total = partial[:, 0].clone()
        for chunk in range(1, chunks):
            total += partial[:, chunk]
        result = rows.new_zeros(num_weights, rows.shape[1])
        result[ordered[starts]] = total
        if padding_idx >= 0:
            result[padding_idx] = 0
        return result.to(grad_output.dtype)

    return kernel


_INDEX_PUT = ("index_put_.default", "index_put.default")


def _index_put(op, name: str):
    """``index_put(accumulate=True)`` of a half type (an advanced index's gradient: ``x[ids]``'s backward) as CUDA's
    kernel adds it: each position's values and its old value added in float32 and rounded once, where the CPU adds
    them in the half type (12% off over 4,000 values of one position in bfloat16)."""
    plain = KERNELS.get(op, op)
    in_place = name.startswith("index_put_")

    def kernel(self, indices, values, accumulate=False):
        if not accumulate or self.dtype not in (torch.float16, torch.bfloat16):
            return plain(self, indices, values, accumulate)
        acc = accumulate_dtype(self.dtype)
        # the aten op, not the method: an index list may hold None (x[:, ids])
        summed = torch.ops.aten.index_put_.default(self.to(acc), indices, values.to(acc), True).to(self.dtype)
        return self.copy_(summed) if in_place else summed

    return kernel


# Ops whose CPU kernel computes a half type's terms in that type, where CUDA's does in float32 (op_tools' op facts
# ``cpu_sums_narrow``: prod's product, fold's sums, grid_sample's corner weights): in this mode computed in float32
# and rounded once
_FLOAT32_INSIDE = ("prod.default", "prod.dim_int", "col2im.default", "grid_sampler_2d.default",
                   "grid_sampler_3d.default")


def _float32_inside(op, name: str):
    """The op on float32 copies of its float16 or bfloat16 arguments, its float32 results rounded back once; a call
    that names a dtype, or has no half-type argument, runs as the CPU's."""
    plain = KERNELS.get(op, op)

    def kernel(*args, **kwargs):
        values = (*args, *kwargs.values())
        narrow = next((a.dtype for a in values if isinstance(a, torch.Tensor) and a.dtype in _HALF), None)
        if narrow is None or any(isinstance(a, torch.dtype) for a in values):
            return plain(*args, **kwargs)

        def wide(a):
            return a.to(torch.float32) if isinstance(a, torch.Tensor) and a.dtype == narrow else a

        out = plain(*map(wide, args), **{k: wide(v) for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return tuple(t.to(narrow) if t.dtype == torch.float32 else t for t in out)
        return out.to(narrow) if out.dtype == torch.float32 else out

    return kernel


_HALF = (torch.float16, torch.bfloat16)


class Numerics:
    """Which numerics sim computes with: ``cpu`` (the CPU's kernels) or ``gpu`` (this module's sums)."""

    def __init__(self) -> None:
        self.mode = "cpu"
        self._lock = threading.Lock()
        self._gemms: dict = {}  # GEMM overload -> the kernel it had before this mode

    def set(self, mode: str) -> None:
        mode = parse_mode(mode)
        with self._lock:
            if mode == self.mode:
                return
            for name in _OPS:
                op = overload(name)
                if mode == "gpu":
                    KERNELS[op] = _kernel(op, name.startswith("mean"), "dim" in name)
                else:
                    KERNELS.pop(op, None)
            for table, make in ((_FUSED_MULTIPLY_ADDS, _fused_multiply_add), (_LOG_SOFTMAX, _log_softmax),
                                (_SOFTMAXES, _softmax), (_EMBEDDING_BACKWARD, _embedding_backward),
                                (_INDEX_PUT, _index_put), (_FLOAT32_INSIDE, _float32_inside)):
                for name in table:
                    op = overload(name)
                    if mode == "gpu":
                        KERNELS[op] = make(op, name)
                    else:
                        KERNELS.pop(op, None)
            for name in _GEMMS:  # the kernels they had (TF32's, which read CUDA's switch) back when off
                op = overload(name)
                if mode == "gpu":
                    self._gemms[op] = KERNELS.get(op)
                    KERNELS[op] = _split_k(op, name)
                else:
                    previous = self._gemms.pop(op, None)
                    if previous is None:
                        KERNELS.pop(op, None)
                    else:
                        KERNELS[op] = previous
            self.mode = mode


NUMERICS = Numerics()
