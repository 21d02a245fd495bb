"""Every hook an AutoFuser plugin can implement.

A plugin is a module (or any object) with functions named after these hooks;
the ``@autofuser.hookimpl`` marker is optional for functions whose names start
with ``autofuser_``, and a function with that prefix that matches no hook below
is an error when the plugin loads - a misspelled hook never goes silent.

Registration hooks receive a ``register`` callback and return nothing. The
core calls each plugin's implementation separately, so it knows which plugin
registered which spec; order between plugins carries no meaning (``priority``
in a spec, not load order, decides who wins a target).
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "autofuser"

#: ``gm.meta`` key a graph pass reads: whether the graph is compiled with gradients on
#: (each fused group then gets a backward graph), ``False`` for inference.
GRADIENTS_KEY = "autofuser_gradients"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------
# Registration: called once per plugin when a plugin set is loaded
# ---------------------------------------------------------------------------


@hookspec
def autofuser_register_lowerings(register):
    """Register op lowerings.

    Called once per plugin, when ``fuse()`` (or ``load_plugins()``) loads it.

    :param register: call ``register(LoweringSpec(...))`` or
        ``register(name=..., targets=..., kind=..., lower=...)`` once per op.
        The spec is validated on the spot; an invalid spec, a duplicate name or
        a tie on a target raises ``SpecError`` naming this plugin.
    """


@hookspec
def autofuser_register_strategies(register):
    """Register tiling strategies (``StrategySpec``), which propose fusion groups
    and write their kernels.

    Called once per plugin when it is loaded. A strategy's groups are composed
    by the generic ``compose_group`` unless the spec sets ``compose(view,
    nodes) -> GroupProgram``: then the planner calls that for the strategy's
    candidates (it may raise ``GroupRefused``), which is how a strategy takes
    ops lowered as ``ctx.extern()`` or lays a group out its own way
    (``autofuser_core.group.program_from_nodes`` builds the inputs and
    outputs). A strategy's ``priority`` orders candidates before their size.

    :param register: as for ``autofuser_register_lowerings``, with ``StrategySpec``.
    """


@hookspec
def autofuser_register_quantizers(register):
    """Register weight quantisers (``QuantizerSpec``).

    Called once per plugin when it is loaded. ``fuse(model, quantize=format)``
    picks the quantiser whose ``format`` matches and calls its ``replace`` on
    each selected layer of a copy of the model; the plugin's lowerings make
    the quantised layer's weight a packed weight (``ctx.packed_weight``) that
    the product kernels decode in registers.

    :param register: as for ``autofuser_register_lowerings``, with ``QuantizerSpec``.
    """


@hookspec
def autofuser_register_product_layouts(register):
    """Register layouts for groups with matrix products (``ProductLayoutSpec``, whose
    docstring states how the generic composition uses them), one per number of
    products: the matmul plugin registers one product's and two's (an MLP block).

    Called once per plugin when it is loaded. A strategy then finds such groups
    composed with the layout's object as ``program.product_layout``.

    :param register: as for ``autofuser_register_lowerings``, with ``ProductLayoutSpec``.
    """


@hookspec
def autofuser_register_options(register):
    """Register this plugin's ``fuse()`` options, so the plugin owns them, not the core.

    Called once per plugin when it is loaded, before any option is read.
    ``fuse(model, **options)`` then accepts the plugin's option names next to the
    core's ``FuseOptions``, validates them with the plugin's model (an invalid value
    raises ``AutoFuserError`` naming the option and this plugin; a name no loaded
    plugin owns is refused, listing every known option and its owner), and the
    ``FuseOptions`` that hooks and strategies receive (``view.options``) has each one
    as an attribute: ``options.my_option`` (its default when not given). Read it
    with ``getattr(options, "my_option", default)`` where options may be ``None``.

    :param register: call ``register(MyOptions)`` with a pydantic model class, or
        ``register(my_option=(bool, Field(False, strict=True, description="...")))``.
        Every field needs a default and a description; the model should forbid
        unknown names and use strict types, as ``FuseOptions`` does (named fields
        get ``frozen=True, extra="forbid"``). A name the core or another plugin
        already has, or options registered twice, raises ``SpecError``.
    """


# ---------------------------------------------------------------------------
# Policy and graph passes: called for every compiled graph
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def autofuser_veto_fusion(group, options):
    """Refuse a fusion group the planner is about to keep.

    Called for every candidate that passed the planner's own legality rules;
    the first non-``None`` result wins.

    :param group: the ``autofuser_core.planner.Candidate`` (``.strategy``,
        ``.nodes``, ``.program``).
    :param options: the ``FuseOptions`` of this ``fuse()`` call.
    :return: ``None`` to allow, or a sentence saying why not (reported with
        reason code ``vetoed``).
    """


@hookspec
def autofuser_transform_graph(gm, options):
    """Rewrite the captured graph before lowering, in place.

    Called once per compiled signature, after capture and before planning, for
    every plugin (all are called; results are ignored). The graph must keep
    computing the same function; ``gm.recompile()`` is done by the core. File
    each node you add with ``autofuser.annotate_node(node, value, inputs)``: its
    ``tensor_meta`` from a tensor computed alike (a meta tensor will do) and
    whether it is a view of ``inputs``, which the report counts as free (the
    capture judged its own nodes from the values it saw).

    :param gm: the captured ``torch.fx.GraphModule``, with ``tensor_meta`` on
        its nodes; ``gm.meta[autofuser.GRADIENTS_KEY]`` says whether it is
        compiled with gradients on (a pass that serves only the backward can
        leave an inference graph alone).
    :param options: the ``FuseOptions`` of this ``fuse()`` call.
    """
