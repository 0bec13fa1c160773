"""The descriptor every standardized value is made of.

A `Value` is nnsight's ``eproperty`` whose key is a *path* from the envoy that
hosts it, so one descriptor serves a value wherever a family keeps it: on the
host module, on a child or sibling module, or at an operation inside a forward.
It can also say why it is unavailable on a given model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from greenlet import getcurrent
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.eproperty import WriteBack, eproperty
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.util import first_input, replace_first_input

from ..errors import UnavailableValue

#: ``select`` for "the tensor": the whole value, or its first element when it is a tuple.
FIRST = "<first>"
#: ``select`` for the whole served value, untouched.
WHOLE = None

Reason = str | Callable[[Envoy], str | None] | None

#: Why a value cannot be read outside nnsight (see `Value.located`).
NNSIGHT_ONLY = "it is computed or reshaped while a trace runs; read it through nnsight (StandardizedVLLM)"
AT_AN_OPERATION = (
    "it lives at an operation inside a forward, which only nnsight reaches; read it through StandardizedVLLM"
)


@dataclass(frozen=True)
class Located:
    """Where a value lives on the loaded module tree, for a reader inside the engine's compiled model (no nnsight).

    ``module`` is the path of a module from the root module (``""`` for the root itself), ``attribute`` the
    hook point there: ``"output"`` (what the module returns), ``"input"`` or ``"inputs"`` (its call's
    ``(args, kwargs)``); ``flat`` is pure tensor code from what a hook at that point sees to the value as
    ``[tokens, ...]``, so it can run inside a compiled graph. ``part`` reads the value's part as the module holds
    it (unscaled, with any batch axis it has) and ``replaced`` gives back what the hook sees with that part
    replaced, for a writable value (``None`` where the value is read-only).
    """

    module: str
    attribute: str
    flat: Callable[[Any], torch.Tensor]
    part: Callable[[Any], torch.Tensor] | None = None
    replaced: Callable[[Any, torch.Tensor], Any] | None = None


def first_tensor(value: Any) -> Any:
    """The tensor of a module output: the first element when the module returns a tuple."""
    return value[0] if isinstance(value, tuple) else value


class Value(eproperty):
    """A standardized value: a location relative to its host envoy, a selection in it, a reason it may be missing.

    Args:
        key: Where the value lives, from the host envoy: dotted segments ending in
            ``output``, ``input`` (the first argument) or ``inputs`` (``(args,
            kwargs)``). A segment is a child module (aliases included), ``source``
            (the operations of that module's or operation's forward) or an
            operation name; a leading ``../`` steps to the parent envoy.
            ``{self.NAME}`` placeholders are filled from the host, so a component
            can leave an operation name to the family (``"source.{self.INTERFACE}.inputs"``).
        select: Which part of the served value: `FIRST` (the tensor, or the first
            element of a tuple), `WHOLE`, an int (a positional argument of
            ``inputs``, an index of a tuple ``output``) or a str (a keyword
            argument of ``inputs``, an attribute of an ``output`` object). A write
            puts the part back into the current value.
        description: One line for the model's repr.
        unavailable: A reason string, or a function of the host returning a reason
            or ``None``. A reason makes reads and writes raise `UnavailableValue`.
        writable: ``False`` for a derived, read-only value.
    """

    def __init__(
        self,
        key: str = "output",
        *,
        select: Any = FIRST,
        description: str = "",
        unavailable: Reason = None,
        writable: bool = True,
    ) -> None:
        super().__init__(key=key, description=description)
        self.__doc__ = description
        self.select = select
        self.unavailable = unavailable
        self.writable = writable

    def __set_name__(self, owner: type, name: str) -> None:
        if self.name is None:
            self.name = name

    def __call__(self, preprocess: Callable) -> Value:
        key = self.key
        super().__call__(preprocess)
        self.key = key
        return self

    # -- availability ---------------------------------------------------------

    def reason(self, host: Envoy) -> str | None:
        """Why this value is not available on ``host``, or ``None`` when it is."""
        if callable(self.unavailable):
            return self.unavailable(host)
        return self.unavailable

    def check(self, host: Envoy) -> None:
        """Raise `UnavailableValue` when this value is not available on ``host``, and a `ValueError`
        naming the fix when it is used outside a trace."""
        try:
            reason = self.reason(host)
        except AttributeError as error:  # never let it fall through to Envoy.__getattr__
            raise RuntimeError(f"the availability check of {self.name} on {host.path} failed: {error}") from error
        if reason:
            family = getattr(type(host), "__module__", "?").rsplit(".", 1)[-1]
            raise UnavailableValue(f"{self.name} is not available on {host.path} (family {family!r}): {reason}")
        require_trace(f"{host.path}.{self.name}")

    # -- location -------------------------------------------------------------

    def path(self, host: Envoy) -> str:
        """The key with the host's placeholders filled in."""
        return self.key.format(self=host) if "{" in self.key else self.key

    def locate(self, host: Envoy) -> tuple[str, str]:
        """The served location of this value on ``host`` and its last segment (``output``/``input``/``inputs``)."""
        key = self.path(host)
        node: Any = host
        while key.startswith("../"):
            node, key = node.parent, key[3:]
        *walk, attribute = key.split(".")
        for part in walk:
            node = getattr(node, part)
        served = "input" if attribute == "inputs" else attribute
        return f"{node.path}.{served}", attribute

    def located(self, host: Envoy) -> Located | str:
        """Where this value lives on ``host``'s module tree and how it is read there without nnsight
        (`Located`), or why it cannot be: the reason it is unavailable, or why only nnsight reads it."""
        reason = self.reason(host)
        if reason:
            return reason
        flat = self.flat_part(host)
        if isinstance(flat, str):
            return flat
        location, attribute = self.locate(host)
        if ".source." in f".{location}":
            return AT_AN_OPERATION
        module, root = location.rsplit(".", 1)[0], host.root.path
        module = "" if module == root else module.removeprefix(f"{root}.")
        select = self.selection(host)

        def part(raw: Any) -> torch.Tensor:
            return self.pick(attribute, raw, select)

        def replaced(raw: Any, value: torch.Tensor) -> Any:
            return self.put(attribute, raw, value, select)

        return Located(module, attribute, lambda raw: flat(part(raw)), part, replaced if self.writable else None)

    def flat_part(self, host: Envoy) -> Callable[[Any], torch.Tensor] | str:
        """How the selected part of the served value becomes this value as ``[tokens, ...]`` without nnsight
        (pure tensor code), or why it cannot: a value read or reshaped by code that runs in a trace."""
        if type(self).read is not Value.read or self._preprocess is not None:
            return NNSIGHT_ONLY
        return _unchanged

    # -- selection ------------------------------------------------------------

    def selection(self, host: Envoy) -> Any:
        """The ``select`` in force on ``host`` (a function of the host is called)."""
        return self.select(host) if callable(self.select) else self.select

    def pick(self, attribute: str, raw: Any, select: Any) -> Any:
        """The selected part of a served value."""
        if attribute == "input":
            return first_input(*raw)
        if select is WHOLE:
            return raw
        if select == FIRST:
            return first_tensor(raw)
        if attribute == "inputs":
            args, kwargs = raw
            return kwargs[select] if isinstance(select, str) else args[select]
        return getattr(raw, select) if isinstance(select, str) else raw[select]

    def put(self, attribute: str, current: Any, part: Any, select: Any) -> Any:
        """``current`` with the selected part replaced by ``part``."""
        if attribute == "input":
            return replace_first_input(*current, part)
        if select is WHOLE:
            return part
        if select == FIRST:
            return (part, *current[1:]) if isinstance(current, tuple) else part
        if attribute == "inputs":
            args, kwargs = current
            if isinstance(select, str):
                return args, {**kwargs, select: part}
            args = list(args)
            args[select] = part
            return tuple(args), kwargs
        if isinstance(select, str):
            setattr(current, select, part)
            if hasattr(current, "__setitem__") and not isinstance(current, tuple):
                current[select] = part
            return current
        items = list(current)
        items[select] = part
        return tuple(items)

    # -- what the user holds ---------------------------------------------------

    #: Whether a read hands out a copy whose in-place edits must be written back (see `write_back`).
    writes_back = False

    def writes_back_on(self, host: Envoy) -> bool:
        """Whether a read on ``host`` hands out such a copy (`writes_back`, unless a value says otherwise)."""
        return self.writes_back

    def serve(self, host: Envoy, part: Any) -> Any:
        """What a read returns, from the selected part of the served value."""
        return self._preprocess(host, part) if self._preprocess is not None else part

    def accept(self, host: Envoy, value: Any) -> Any:
        """The part to put back into the model, from what the user wrote."""
        return self._postprocess(host, value) if self._postprocess is not None else value

    def write_back(self, host: Envoy, attribute: str, select: Any, view: Any, raw: Any) -> Any:
        """The served value with the (possibly edited) ``view`` a read handed out put back in."""
        return self.put(attribute, raw, self.accept(host, view), select)

    # -- read and write -------------------------------------------------------

    def __get__(self, host: Envoy | None, owner: Any = None) -> Any:
        if host is None:
            return self
        try:
            return self.read(host)
        except AttributeError as error:
            # A descriptor's AttributeError would fall through to Envoy.__getattr__ and come back
            # as "no attribute <name>", hiding what failed.
            raise RuntimeError(f"reading {self.name} on {host.path} failed: {error!r}") from error

    def read(self, host: Envoy) -> Any:
        """The value on ``host``, inside a trace."""
        self.check(host)
        location, attribute = self.locate(host)
        select = self.selection(host)
        writes_back = self.writes_back_on(host)
        if writes_back:
            mediator = Mediator.current(location)
            occurrence = mediator.wanted(location)
            waiting = mediator.transform
            if waiting is not None and waiting.key == (self, location, occurrence):
                return waiting.view
        raw = Mediator.value(location)
        value = self.serve(host, self.pick(attribute, raw, select))
        if writes_back:
            # Swapped in when the worker next asks the model for anything, so in-place edits
            # of the copy reach the model as an assignment would.
            restore = partial(self.write_back, host, attribute, select, value, raw)
            mediator.transform = WriteBack(restore, value, self, location, occurrence)
        return value

    def peek(self, host: Envoy) -> Any:
        """The value on ``host`` inside a trace, read once with nothing written back into the model (a read the
        library makes for its own use, such as a gate's; a value whose `read` computes it is not peeked)."""
        self.check(host)
        location, attribute = self.locate(host)
        return self.serve(host, self.pick(attribute, Mediator.value(location), self.selection(host)))

    def update(self, host: Envoy, edit: Callable[[Any], Any]) -> None:
        """Replace the value with ``edit(value)`` in one read and one write (no write-back of the read copy)."""
        self.check(host)
        location, attribute = self.locate(host)
        select = self.selection(host)
        raw = Mediator.value(location)
        edited = edit(self.serve(host, self.pick(attribute, raw, select)))
        Mediator.swap(location, self.put(attribute, raw, self.accept(host, edited), select))

    def __set__(self, host: Envoy, value: Any) -> None:
        if not self.writable:
            raise AttributeError(f"{self.name} is read-only: it is derived from other values; write those instead")
        self.check(host)
        location, attribute = self.locate(host)
        select = self.selection(host)
        raw = Mediator.value(location)
        value = conform(f"{host.path}.{self.name}", value, self.serve(host, self.pick(attribute, raw, select)))
        Mediator.swap(location, self.put(attribute, raw, self.accept(host, value), select))


def _unchanged(part: Any) -> Any:
    return part


def require_trace(what: str) -> None:
    """Refuse, naming the fix, when ``what`` is used outside a running trace."""
    if getattr(getcurrent(), "mediator", None) is None:
        raise ValueError(
            f"{what} is only served inside a trace: use it in the body of `with model.trace(prompt):` "
            "(or `with model.generate(prompt, ...):`)"
        )


def conform(what: str, value: Any, current: Any) -> Any:
    """``value``, written in place of ``current``, checked to be a tensor of its shape and cast to its dtype.

    Raises ``ValueError`` naming the value, the shape given and the shape expected, before the
    model sees anything.
    """
    if not isinstance(current, torch.Tensor):
        return value
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{what}: write a tensor of shape {list(current.shape)}, got {type(value).__name__} "
            "(edit in place, e.g. `value[:] = 0`, or assign a tensor)"
        )
    if value.shape != current.shape:
        raise ValueError(
            f"{what}: the assigned tensor has shape {list(value.shape)}; it must have the value's shape "
            f"{list(current.shape)}"
        )
    if not torch.can_cast(value.dtype, current.dtype):
        raise ValueError(f"{what}: a {value.dtype} tensor cannot be written into a {current.dtype} value")
    return value.to(device=current.device, dtype=current.dtype)


def unavailable(reason: str) -> Value:
    """A value a family does not have, assigned in the class body in place of the inherited one."""
    return Value(description=f"unavailable: {reason}", unavailable=reason)


class Delegate(Value):
    """A value read and written as another envoy's value: ``Delegate("self_attn", "attention_output")``."""

    def __init__(self, child: str, name: str, *, description: str = "") -> None:
        super().__init__(key=f"{child}.{name}", description=description)
        self.child, self.target = child, name

    def host_of(self, host: Envoy) -> Envoy | None:
        """The envoy the value is delegated to, or ``None`` when the host has no such child."""
        child = getattr(host, self.child, None)
        return child if isinstance(child, Envoy) else None

    def reason(self, host: Envoy) -> str | None:
        child = self.host_of(host)
        if child is None:
            return f"this block has no {self.child} module"
        value = type(child).__dict__.get(self.target) or getattr(type(child), self.target, None)
        if not isinstance(value, Value):
            if callable(getattr(type(child), "values", None)):
                # e.g. a hybrid block whose native ``self_attn`` is its linear-attention mixer
                return f"this block has no {self.target}: its {self.child} module is a {type(child).__name__}"
            return f"{self.child} is not a standardized module on this family"
        return value.reason(child)

    def read(self, host: Envoy) -> Any:
        self.check(host)
        return getattr(self.host_of(host), self.target)

    def located(self, host: Envoy) -> Located | str:
        reason = self.reason(host)
        if reason:
            return reason
        child = self.host_of(host)
        return getattr(type(child), self.target).located(child)

    def __set__(self, host: Envoy, value: Any) -> None:
        self.check(host)
        setattr(self.host_of(host), self.target, value)


def writable_value(root: Envoy, name: str, what: str) -> tuple[Envoy, Value]:
    """The envoy and descriptor that hold the value ``name`` (``"layers.0.layer_input"``,
    ``"layers.3.attention_output"``) of a standardized model ``root``, a `Delegate` followed to its target;
    `UnavailableValue` naming ``what`` needed it, where the value is unavailable or read-only there."""
    *path, attribute = name.split(".")
    host = root
    for part in path:
        host = host[int(part)] if part.isdigit() else getattr(host, part)
    value = getattr(type(host), attribute, None)
    while isinstance(value, Delegate) and not value.reason(host):
        host = value.host_of(host)
        value = getattr(type(host), value.target)
    reason = f"it has no {attribute}" if not isinstance(value, Value) else value.reason(host)
    if not reason and not value.writable:
        reason = "it is read-only on this family (derived from other values)"
    if reason:
        raise UnavailableValue(f"{what} writes {name}, and this model cannot: {reason}")
    return host, value


def values_of(cls: type) -> dict[str, Value]:
    """A class's standardized values by name, base classes first (helpers named ``_...`` left out)."""
    found: dict[str, Value] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            if isinstance(attr, Value) and not name.startswith("_"):
                found[name] = attr
    return found


class Scaled(Value):
    """A location's value times a factor: what a block adds where it scales a sublayer's output before adding it.

    ``scale`` names the host module's attribute holding the factor (``"residual_multiplier"``), or is a
    function of the host envoy returning it. A read is a scaled copy whose in-place edits are written
    back unscaled; a written value is unscaled on its way into the model.
    """

    writes_back = True

    def __init__(self, key: str = "output", *, scale: str | Callable[[Envoy], Any], **kwargs: Any) -> None:
        super().__init__(key, **kwargs)
        self.scale = scale

    def factor(self, host: Envoy) -> Any:
        """The factor on ``host``."""
        return self.scale(host) if callable(self.scale) else getattr(host._module, self.scale)

    def serve(self, host: Envoy, part: Any) -> Any:
        return super().serve(host, part * self.factor(host))

    def flat_part(self, host: Envoy) -> Callable[[Any], torch.Tensor] | str:
        unscaled = super().flat_part(host)
        if isinstance(unscaled, str):
            return unscaled
        factor = self.factor(host)
        return lambda part: unscaled(part) * factor

    def accept(self, host: Envoy, value: Any) -> Any:
        return super().accept(host, value) / self.factor(host)


class Derived(Value):
    """A read-only value computed from other values of the same host: ``Derived(lambda model: ...)``."""

    def __init__(self, compute: Callable[[Envoy], Any], *, description: str = "", unavailable: Reason = None) -> None:
        super().__init__(description=description, unavailable=unavailable, writable=False)
        self.compute = compute

    def read(self, host: Envoy) -> Any:
        self.check(host)
        return self.compute(host)
