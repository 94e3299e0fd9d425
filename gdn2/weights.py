"""Framework-neutral pieces of the GDN-2 language model: its configuration, its initial weights,
and the safetensors file format both frameworks read and write.

Both ``gdn2.torch.layer`` and ``gdn2.mlx.layer`` build modules whose parameters have the *same
names and shapes* (``layers.0.attn.q_proj.weight`` ...). A checkpoint is a flat safetensors file
of float32 numpy arrays under those names, with the model configuration as JSON in the metadata
(key ``gdn2_config``), so either framework reads what the other wrote without any conversion.

One layout choice makes this possible: the short-convolution weight is stored as PyTorch's
depthwise ``nn.Conv1d`` weight, ``[channels, 1, kernel_size]``, in both frameworks (the MLX
module keeps that shape and does the convolution as a sum of shifted products).

``initial_weights`` draws the starting weights in numpy from one seed, name by name, so that a
torch model and an MLX model initialised from the same seed are the same model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

CONFIG_KEY = "gdn2_config"


@dataclass
class ModelConfig:
    """Sizes of a GDN-2 language model (and of its token mixer, ``GatedDeltaNet2``).

    The mixer arguments keep flash-linear-attention's names. ``intermediate_size`` None gives
    ``8/3 * hidden_size`` rounded up to a multiple of 32 (a SwiGLU MLP of about 4x the parameters
    of a plain one). ``chunk_size`` is the chunk length of the chunked GDN-2 form (16 is fastest
    on a CPU for short sequences); ``path`` forces a GDN-2 path (None: automatic).
    """

    vocab_size: int = 128
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    expand_v: float = 1.0
    num_v_heads: int | None = None
    use_short_conv: bool = True
    allow_neg_eigval: bool = False
    conv_size: int = 4
    conv_bias: bool = False
    norm_eps: float = 1e-5
    intermediate_size: int | None = None
    chunk_size: int = 64
    path: str | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "conv_size", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, received {value!r}")
        if self.intermediate_size is None:
            self.intermediate_size = 32 * math.ceil(self.hidden_size * 8 / 3 / 32)

    def mixer_kwargs(self) -> dict:
        """Constructor arguments of ``GatedDeltaNet2`` for this model."""
        return dict(
            hidden_size=self.hidden_size,
            expand_v=self.expand_v,
            head_dim=self.head_dim,
            num_heads=self.num_heads,
            num_v_heads=self.num_v_heads,
            use_short_conv=self.use_short_conv,
            allow_neg_eigval=self.allow_neg_eigval,
            conv_size=self.conv_size,
            conv_bias=self.conv_bias,
            norm_eps=self.norm_eps,
            chunk_size=self.chunk_size,
            path=self.path,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        """The config of ``to_json``; ``ValueError`` for invalid JSON, unknown fields or bad values."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"config: expected JSON, received invalid JSON ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"config: expected a JSON object of ModelConfig fields, received {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config: expected ModelConfig fields ({', '.join(sorted(known))}), received unknown {unknown}")
        try:
            return cls(**data)
        except TypeError as error:
            raise ValueError(f"config: {error}") from None


def check_mixer_sizes(hidden_size, expand_v, head_dim, num_heads, num_v_heads, conv_size) -> tuple[int, int, int]:
    """Validate the mixer's sizes; return ``(num_v_heads, head_v_dim, groups)``.

    Raises ``ValueError`` naming the argument when value heads do not divide evenly or
    ``head_dim * expand_v`` is not an integer.
    """
    for name, value in dict(hidden_size=hidden_size, head_dim=head_dim, num_heads=num_heads, conv_size=conv_size).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, received {value!r}")
    num_v_heads = num_heads if num_v_heads is None else num_v_heads
    if isinstance(num_v_heads, bool) or not isinstance(num_v_heads, int) or num_v_heads < num_heads:
        raise ValueError(f"num_v_heads: expected an integer >= num_heads={num_heads}, received {num_v_heads!r}")
    if num_v_heads % num_heads:
        raise ValueError(f"num_v_heads: expected a multiple of num_heads={num_heads}, received {num_v_heads}")
    head_v_dim = head_dim * expand_v
    if expand_v <= 0 or not math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-6):
        raise ValueError(f"expand_v: head_dim * expand_v must be a positive integer, received {head_dim} * {expand_v}")
    return num_v_heads, int(round(head_v_dim)), num_v_heads // num_heads


def _rng(seed: int, name: str) -> np.random.Generator:
    """One generator per parameter name: adding a parameter does not change the others."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def initial_value(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """The float32 starting value of one parameter, chosen by its name.

    - ``A_log`` [H]: ``log(uniform(1, 16))`` (flash-linear-attention's decay rates)
    - ``dt_bias`` [key_dim]: inverse softplus of ``dt`` log-uniform in ``[1e-3, 1e-1]``
    - norm weights: ones; biases: zeros
    - ``embeddings.weight``: normal, std 1 (the final RMSNorm fixes the logit scale)
    - every other weight: uniform in ``+-1/sqrt(fan_in)`` (PyTorch's Linear / Conv1d default),
      fan_in being the product of the non-output dimensions
    """
    rng = _rng(seed, name)
    parts = name.split(".")
    leaf, module = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if leaf == "A_log":
        value = np.log(rng.uniform(1.0, 16.0, shape))
    elif leaf == "dt_bias":
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape)).clip(min=1e-4)
        value = dt + np.log(-np.expm1(-dt))
    elif "norm" in module and leaf == "weight":
        value = np.ones(shape)
    elif leaf == "bias":
        value = np.zeros(shape)
    elif name.endswith("embeddings.weight"):
        value = rng.standard_normal(shape)
    else:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        bound = 1.0 / math.sqrt(fan_in)
        value = rng.uniform(-bound, bound, shape)
    return np.asarray(value, dtype=np.float32)


def initial_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Starting weights for parameters ``{name: shape}``, identical for torch and MLX models."""
    return {name: initial_value(name, tuple(shape), seed) for name, shape in sorted(shapes.items())}


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__)).rsplit(".", 1)[-1]


def check_names(expected: dict[str, tuple[int, ...]], received: dict[str, np.ndarray], source: str) -> None:
    """Raise ``ValueError`` listing missing, unexpected, wrongly shaped and non-float32 parameters.

    Weights are float32 arrays (the gdn2 format): another dtype is an error, not a silent cast.
    """
    missing = sorted(set(expected) - set(received))
    unexpected = sorted(set(received) - set(expected))
    common = sorted(set(expected) & set(received))
    wrong = [
        f"{name}: expected {list(expected[name])}, received {list(np.shape(received[name]))}"
        for name in common
        if tuple(np.shape(received[name])) != tuple(expected[name])
    ]
    dtypes = [f"{name}: expected float32, received {_dtype_name(received[name])}"
              for name in common if _dtype_name(received[name]) != "float32"]
    if missing or unexpected or wrong or dtypes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if wrong:
            parts.append("wrong shapes: " + "; ".join(wrong[:8]))
        if dtypes:
            parts.append("wrong dtypes: " + "; ".join(dtypes[:8]))
        raise ValueError(f"{source}: weights do not match the model: " + ", ".join(parts))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path, write) -> Path:
    """Create ``path`` by ``write(temporary_path)`` then ``os.replace``; return ``path``.

    The temporary file is in the same folder, so the replace is atomic: a reader, an interrupted
    run or a failing ``write`` leaves the previous file whole (or no file), never a partial one.
    The file gets the permissions ``open()`` would give it (``0o666`` less the umask).
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        write(temporary)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def save_numpy(arrays: dict[str, np.ndarray], path, config: ModelConfig | None = None) -> None:
    """Write ``{name: float32 array}`` as safetensors, config JSON in the metadata.

    Written atomically (``write_atomically``): an existing file is replaced whole or not at all.
    Arrays of another dtype are an error (convert them with ``.astype(np.float32)`` first).
    """
    from safetensors.numpy import save_file

    dtypes = [f"{name}: {_dtype_name(a)}" for name, a in arrays.items() if _dtype_name(a) != "float32"]
    if dtypes:
        raise ValueError(f"arrays: expected float32 arrays (the gdn2 weight format), received {'; '.join(dtypes[:8])}")
    metadata = {"format": "gdn2"}
    if config is not None:
        metadata[CONFIG_KEY] = config.to_json()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    contiguous = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    write_atomically(path, lambda temporary: save_file(contiguous, temporary, metadata=metadata))


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def load_numpy(path) -> tuple[dict[str, np.ndarray], ModelConfig | None]:
    """Read a gdn2 safetensors file: ``({name: float32 numpy array}, config or None)``.

    Every problem names the file: ``FileNotFoundError`` when it does not exist, ``ValueError`` for
    a directory, a truncated or corrupt file, an invalid config, or a tensor that is not float32
    (nothing is cast on loading).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path: expected a safetensors file, received a directory: {path}")
    if not path.exists():
        raise FileNotFoundError(f"path: no such file: {path}")
    arrays = {}
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            for name in handle.keys():
                dtype = handle.get_slice(name).get_dtype()
                if dtype != "F32":
                    raise ValueError(
                        f"path: {path}: tensor {name} has dtype {SAFETENSORS_DTYPES.get(dtype, dtype)}, expected float32 "
                        "(gdn2 weight files are float32; nothing is cast on loading)"
                    )
                arrays[name] = handle.get_tensor(name)
    except SafetensorError as error:
        raise ValueError(f"path: {path} is not a readable safetensors file (truncated or corrupt?): {error}") from None
    config = None
    if CONFIG_KEY in metadata:
        try:
            config = ModelConfig.from_json(metadata[CONFIG_KEY])
        except ValueError as error:
            raise ValueError(f"path: {path}: the model config (metadata {CONFIG_KEY!r}) is unusable: {error}") from None
    return arrays, config
