"""Triton's interpreter for the kernel tests: without its per-call re-patching of ``triton.language``, with masks
read as truth values, and without its integer overflow checks.

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` (every builtin, every tensor method) so that
the kernel's Python runs on NumPy, and restores it when the launch ends. Triton 3.x also patches it again at every
call of a ``@triton.jit`` helper from inside the kernel, about half a millisecond each, and never undoes those: the
launch's own restore does. Kernels that call helpers per head or per tile (the rope, norm and FP8 quantization
kernels) spend about a third of their interpreted time there.

``skip_nested_repatching()`` makes a helper call skip the patching when the running launch has already patched every
language module the helper can see, which is the case whenever the helper's module imports ``triton.language`` as the
kernel's does. A helper that sees a module the launch did not patch is patched as before. The kernels compute the
same values either way: a kernel that ran unpatched code would fail, not drift (``tl`` functions refuse to run
outside a kernel's scope).

``masks_as_truth_values()`` works around Triton 3.9's interpreter, where a mask combined from a block comparison and a
scalar one (``offs < n & (row < num_rows)``) holds int32 values, which its masked loads and stores refuse ("mask has
unsupported dtype"); compiled kernels take such masks, and so does the interpreter of Triton 3.6-3.8. A mask is a
truth value per lane, so the loads and stores get it as booleans.

``no_overflow_checks()`` turns off the interpreter's ``sanitize_overflow`` option, under which every add, subtract
and multiply of 32-bit integers in a kernel is computed again in 64 bits and compared with the 32-bit range for a
device assert: about a fifth of the kernel tests' interpreted time. That assert is never made: ``tl.device_assert``
does nothing unless the options' ``debug`` is on, and the interpreter's options have it off (Triton 3.8; an
overflowing product wraps, as in a compiled kernel). The comparisons are computed and thrown away: nothing that was
checked before goes unchecked now.
"""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _language_modules(fn) -> frozenset[int]:
    """The language modules ``fn``'s globals hold, as the interpreter's patching picks them."""
    import triton.language as tl

    return frozenset(id(value) for value in fn.__globals__.values()
                     if inspect.ismodule(value) and value in (tl, tl.core))


def skip_nested_repatching() -> None:
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_type is None or getattr(patch, "skips_nested", False):
        return  # another Triton than the one this was written against (3.6-3.8), or already done
    patched: list[frozenset[int]] = []  # the language modules patched by the launch that is running, if any

    def patch_once(fn):
        langs = _language_modules(fn)
        if patched and langs <= patched[0]:
            return scope_type()  # a helper called by the running launch: already patched, nothing to undo
        scope = patch(fn)
        if patched:  # a helper that sees a module the launch did not patch: patched now, undone with the launch
            patched[0] = patched[0] | langs
            return scope
        patched.append(langs)  # a launch: its restore ends it
        restore = scope.restore

        def restore_and_forget():
            patched.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_once.skips_nested = True
    interpreter._patch_lang = patch_once


def masks_as_truth_values() -> None:
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder.create_masked_load, "casts_masks", False):
        return

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    load, store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, other, *args):
        return load(self, ptrs, as_bool(mask), other, *args)

    def create_masked_store(self, ptrs, value, mask, *args):
        return store(self, ptrs, value, as_bool(mask), *args)

    create_masked_load.casts_masks = True
    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store


def no_overflow_checks() -> None:
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not getattr(options, "sanitize_overflow", False):
        return  # another Triton than the one this was written against, or already done
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
