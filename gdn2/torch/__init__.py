"""GDN-2 for PyTorch: ``from gdn2.torch import chunk_gdn2``."""

from .ops import chunk_gdn2, recurrent_gdn2, which_path
from .layer import GatedDeltaNet2, GDN2Cache, GDN2LanguageModel, load_model, load_weights, save_weights
from ..weights import ModelConfig

__all__ = [
    "chunk_gdn2",
    "recurrent_gdn2",
    "which_path",
    "GatedDeltaNet2",
    "GDN2Cache",
    "GDN2LanguageModel",
    "ModelConfig",
    "load_model",
    "load_weights",
    "save_weights",
]
