"""Gradient codecs: how a float32 gradient is compressed for the wire, one codec to a module here.

A codec is one class (a Codec subclass, _codec.py) in a module of this package: its kind (its name in
the `compression` option and in the request's header), how its argument is parsed, its main tensor's
dtype and its auxiliary tensors, whether the worker keeps error feedback for it and how, whether a
table's rows may take it, its encode and its decode. The registry (_registry.py) finds every module
whose name does not start with "_": adding a codec is adding such a file. The option (base/options/options.py,
compression_spec.py), the worker (client/compression.py) and the PS (wire/gradient_codec.py) all
use the registry; each codec module's docstring gives its format. The codecs live in the base, not
in wire/, because Options (base/options/options.py) refuses an unknown codec or a bad argument when it is
built, and the base imports nothing above it.
"""

from paramserver.base.codecs._codec import NONE, Codec, Encoded, aux_name
from paramserver.base.codecs._registry import discover, parse, registered, usage

__all__ = ["NONE", "Codec", "Encoded", "aux_name", "discover", "parse", "registered", "usage"]
