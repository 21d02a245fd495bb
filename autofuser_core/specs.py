"""The spec types plugins register: lowerings, strategies, quantisers, product layouts.

Specs are pydantic models, frozen and refusing unknown fields, so a typo in a
plugin (``tolerance=`` for ``tolerances=``) fails when the plugin registers,
not when a user's model is compiled. The registry stamps ``plugin`` with the
registering plugin's name; plugins leave it unset.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The floating dtypes every kernel loads and stores; kernels compute in fp32.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
KNOWN_DTYPES = FLOAT_DTYPES + ("float64", "bool", "int8", "uint8", "int16", "int32", "int64")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling specs and reports use."""
    return str(dtype).removeprefix("torch.")


class Spec(BaseModel):
    """Common base: frozen, strict about unknown fields, stamped with its plugin."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str = Field(min_length=1, description="Unique name, e.g. 'elementwise.gelu'.")
    description: str = ""
    priority: int = Field(
        0, description="Higher wins when two specs claim the same target; equal is a tie and an error."
    )
    plugin: Optional[str] = Field(None, description="Set by the registry: the plugin that registered this spec.")


class Tolerance(BaseModel):
    """``|fused - eager| <= atol + rtol * |eager|`` element by element (for fp16/bf16
    outputs, ``atol`` times the row's largest magnitude above 1, and the mean error held
    to the plain bound; docs/architecture.md, Tolerances)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)


#: Defaults for fused-vs-eager checks; fp32 leaves room for a different summation order.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-5, rtol=1e-4),
    "float16": Tolerance(atol=1e-3, rtol=1e-2),
    "bfloat16": Tolerance(atol=1e-2, rtol=4e-2),
    # Not a dtype: fp32 products run in TF32 where torch allows it (10-bit mantissa operands).
    "tf32": Tolerance(atol=5e-3, rtol=1e-2),
}

#: For ops that sum products (matrix products, convolutions) in another order than the
#: library eager calls: fp32 needs a little more room than a pointwise op; fp16/bf16
#: round their operands as eager does.
PRODUCT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "float16": Tolerance(atol=2e-3, rtol=1e-2),
    "bfloat16": Tolerance(atol=2e-2, rtol=4e-2),
}


class Sample(BaseModel):
    """One set of inputs for a lowering's conformance check."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = Field(default_factory=dict)
    note: str = ""


#: What a lowering's op is, for strategies choosing groups (``PlanningView.kinds``).
#: "opaque": none of the others, e.g. an op lowered as ``ctx.extern()`` (a whole attention,
#: an FFT block), which only a strategy with its own compose takes.
LoweringKind = Literal["pointwise", "reduction", "matmul", "layout", "opaque"]


class LoweringSpec(Spec):
    """How one op (in all its forms) becomes kernel IR.

    ``targets`` lists what the op looks like in an fx graph: callables for
    ``call_function`` nodes (``torch.add``, ``operator.add``, ``F.gelu``),
    strings for ``call_method`` nodes (``"add"``), and ``nn.Module`` subclasses
    for ``call_module`` nodes (``nn.GELU``). ``lower(ctx, *args, **kwargs)``
    receives the node's own arguments and returns an IR value built through
    ``ctx`` (see ``autofuser_core.ir.LoweringContext``), or calls
    ``ctx.refuse(code, reason)`` for an argument combination it can't serve.

    ``dtypes`` are the dtypes the op's tensors (inputs and result) may have;
    boolean tensors (conditions, comparison results) are always accepted.

    ``references`` are callables written in the op's forms; the conformance
    test traces each on every sample from ``samples(dtype)`` and compares the
    fused result with eager within ``tolerances``.
    """

    targets: tuple[Any, ...] = Field(min_length=1)
    kind: LoweringKind
    lower: Callable[..., Any]
    dtypes: tuple[str, ...] = FLOAT_DTYPES
    samples: Optional[Callable[[torch.dtype], list[Sample]]] = None
    references: tuple[Callable[..., Any], ...] = ()
    tolerances: dict[str, Tolerance] = Field(default_factory=lambda: dict(DEFAULT_TOLERANCES))

    @field_validator("targets")
    @classmethod
    def _targets_are_recognisable(cls, targets: tuple[Any, ...]) -> tuple[Any, ...]:
        for target in targets:
            if isinstance(target, str):
                if not target.isidentifier():
                    raise ValueError(f"method target {target!r} is not a method name")
            elif isinstance(target, type):
                if not issubclass(target, torch.nn.Module):
                    raise ValueError(f"class target {target.__name__} is not an nn.Module subclass")
            elif not callable(target):
                raise ValueError(f"target {target!r} is neither a callable, a method name nor an nn.Module subclass")
        return targets

    @field_validator("dtypes")
    @classmethod
    def _dtypes_known(cls, dtypes: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [d for d in dtypes if d not in KNOWN_DTYPES]
        if unknown:
            raise ValueError(f"unknown dtype name(s) {unknown}; use names like {list(FLOAT_DTYPES)}")
        return dtypes

    @field_validator("tolerances")
    @classmethod
    def _tolerance_keys_known(cls, tolerances: dict[str, Tolerance]) -> dict[str, Tolerance]:
        unknown = [d for d in tolerances if d not in KNOWN_DTYPES and d != "tf32"]
        if unknown:
            raise ValueError(f"tolerances name unknown dtype(s) {unknown}")
        return {**DEFAULT_TOLERANCES, **tolerances}

    @model_validator(mode="after")
    def _samples_need_references(self) -> "LoweringSpec":
        if self.samples is not None and not self.references:
            raise ValueError("samples were given but no references to compare them against")
        return self

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype_name(dtype), DEFAULT_TOLERANCES["float32"])


class SplitRule(BaseModel):
    """A split of a strategy's kept group that the group is timed against (on a GPU).

    ``autofuser_core.compile`` holds a kept group that beat eager back while the
    next planning round re-plans its nodes under the first of its strategy's
    ``split_rules`` that ``applies(program)`` to it (its composed program), then,
    while the group keeps winning, each round after under the next; the faster
    side runs. In such a round every group grown or proposed over the held
    group's nodes stays inside them, holds at most ``fewer_products`` products
    fewer than the held group, and is refused where ``refuse(program)`` returns
    ``(reason_code, sentence)``. ``first_round_only``: only for groups kept in the
    first round. ``description`` completes "timing N group(s) against their split ...".
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    description: str = Field(min_length=1)
    applies: Callable[..., bool]
    fewer_products: int = Field(0, ge=0)
    refuse: Optional[Callable[..., Any]] = None
    first_round_only: bool = False


class StrategySpec(Spec):
    """A tiling strategy: which groups it can generate, and how.

    Called by the planner in this order:

    1. ``propose(view)`` -> list of node lists: candidate groups in the graph
       (``view`` is an ``autofuser_core.planner.PlanningView``). Candidates
       are then considered by strategy ``priority`` (higher first), then
       largest first: a specialised strategy whose groups overlap generic
       ones (a whole attention against its scores' softmax) takes priority 1.
       Each candidate is composed into a ``GroupProgram`` by ``compose(view,
       nodes)`` when the strategy has one (nodes in graph order; it may raise
       ``autofuser_core.group.GroupRefused(code, sentence)``, which the
       report shows), else by the generic ``view.compose(nodes)``. A strategy
       needs its own ``compose`` for groups the generic composition refuses
       (extern ops, ``ctx.extern()``) or lays out otherwise;
       ``autofuser_core.group.program_from_nodes`` gives it the group's
       inputs and outputs to start from, and it may return a subclass of
       ``GroupProgram`` carrying what its ``generate`` needs.
    2. ``accepts(program)`` -> ``None`` or ``(reason_code, sentence)``: a final
       say on a composed ``GroupProgram`` (shapes, dtypes, reductions).
    3. ``configs(program)`` -> candidate launch configs (dicts over
       ``block_params`` plus ``num_warps``/``num_stages``); ``is_valid(program,
       config)`` -> ``None`` or a reason, filters them (registers, shared memory,
       divisibility). ``default_config(program)`` is used when there is no
       tuning (the Triton interpreter) and must be valid. Tuning compiles and
       times the valid configs in the listed order, at most
       ``max_tuned_configs`` of them (``None``: all): each config is a Triton
       compile on the first call, so a strategy with a long list and large
       kernels lists its usual winners first and caps the list.
    4. ``generate(program, helpers)`` -> ``autofuser_core.codegen.KernelSource``
       (``helpers``: the ``@triton.jit`` helper functions lowerings asked for,
       by name).
    5. ``split_rules``: on a GPU, the splits of a kept group's nodes it is timed
       against, in order (``SplitRule``); none by default.
    6. ``dynamic_sizes``: whether ``generate`` writes every size, stride and
       element count of its indexing through ``autofuser.kernel.sized`` and
       assembles its kernel with ``write_kernel`` or ``assemble_kernel``, so a
       dimension that varies between calls reaches its kernel as a run-time
       argument (docs/dynamic.md). ``False`` (the default): its kernels stay
       specialised on each shape, which is always correct. A form of its
       groups it can't write so, ``generate`` writes inside
       ``autofuser.kernel.literal_sizes(reason)``: specialised, with the reason
       in the report.
    7. ``writes_saved_outputs``: whether ``generate`` writes every output of the
       programs it is given, those only a backward reads included
       (``KernelTensor.saved``: a product's result inside the group). With
       gradients on, a kept group of such a strategy is composed again with
       its products' results as outputs (when its ``compose`` and ``accepts``
       take that), and its backward reads them instead of computing the
       products again; other groups recompute them (docs/training.md).
    """

    block_params: tuple[str, ...] = ()
    propose: Callable[..., list]
    compose: Optional[Callable[..., Any]] = None
    accepts: Callable[..., Any] = Field(default=lambda program: None)
    configs: Callable[..., list[dict]]
    default_config: Callable[..., dict]
    is_valid: Callable[..., Optional[str]] = Field(default=lambda program, config: None)
    max_tuned_configs: Optional[int] = Field(default=None, ge=1)
    generate: Callable[..., Any]
    split_rules: tuple[SplitRule, ...] = ()
    dynamic_sizes: bool = Field(default=False, strict=True)
    writes_saved_outputs: bool = False


class QuantizerSpec(Spec):
    """A block-scaled weight format and how a layer is quantised to it.

    - ``quantize(weight) -> {"data": ..., "scales": ...}``: a ``[N, K]`` float
      weight (reduction dim last) to its element tensor (``K`` padded to a
      multiple of ``block_size``) and one scale per ``block_size`` elements;
      raises ``ValueError`` on a weight it can't encode (NaN, infinity);
    - ``dequantize(data, scales, k) -> tensor``: the plain-torch reference,
      fp32 ``[N, k]``, that the fused kernels are checked against;
    - ``replace(module) -> module``: the quantised layer that takes the place
      of a float layer of one of ``module_types`` (exact types): its buffers
      hold the packed tensors, so ``state_dict`` round-trips, and its forward
      computes through the dequantised weight - which a lowering of the same
      plugin turns into a product that decodes the weight in registers.
    """

    format: str = Field(min_length=1)
    block_size: int = Field(gt=0)
    quantize: Callable[..., dict]
    dequantize: Callable[..., torch.Tensor]
    module_types: tuple[type, ...] = (torch.nn.Linear,)
    replace: Callable[..., torch.nn.Module]


class ProductLayoutSpec(Spec):
    """How the generic composition lays out a group with ``products`` matrix products.

    For a group with ``products`` (one, or several up to
    ``autofuser_core.group.MAX_PRODUCTS``) ``compose_group`` calls
    ``lay_out(program, values)`` of the layout registered for that count
    (``values``: every IR value of the group, by uid), which sets the
    program's ``domain``, output strides and ``matmul`` (the layout object its
    strategy's ``accepts``/``generate`` read), or raises
    ``autofuser_core.group.GroupRefused``. Groups grown by
    ``PlanningView.space_groups()`` take such unions in through it. With no
    layout for the count, the group is refused (``several_products``, or
    ``no_product_layout`` for one product). The
    highest ``priority`` for a count wins; equal is a tie and an error.
    """

    products: int = Field(ge=1, description="The number of matrix products in the groups it lays out.")
    lay_out: Callable[..., None]
