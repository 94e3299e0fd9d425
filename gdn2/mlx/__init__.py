"""GDN-2 for MLX: ``from gdn2.mlx import chunk_gdn2``."""

from .chunk import chunk_gdn2, recurrent_gdn2, which_path

__all__ = ["chunk_gdn2", "recurrent_gdn2", "which_path"]
