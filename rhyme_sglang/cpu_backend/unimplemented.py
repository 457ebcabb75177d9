"""Placeholders for ``sgl_kernel`` ops the CPU backend does not implement."""


def not_implemented(op_name: str):
    def _op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel stand-in op {op_name!r} is not implemented by rhyme-sglang's CPU "
            "backend (use a GPU machine with the real sgl-kernel for this model/feature)"
        )

    _op.__name__ = op_name.rsplit(".", 1)[-1]
    _op.__qualname__ = _op.__name__
    return _op
