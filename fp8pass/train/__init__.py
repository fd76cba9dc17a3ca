"""A small trainer for Llama-style models: recipes bf16 / fp8 / fp8-smooth / fp8-smooth-fp8adam.

``python -m fp8pass train`` runs it from the command line; :func:`train` from Python.
"""

from .data import TextData, load_text_data
from .loop import TrainConfig, TrainResult, lr_at, train
from .model import ModelConfig, SwiGLUMLP, TinyLlama
from .plots import plot_runs
from .recipes import RECIPES, Recipe, get_recipe

__all__ = ["TextData", "load_text_data", "TrainConfig", "TrainResult", "lr_at", "train", "ModelConfig",
           "SwiGLUMLP", "TinyLlama", "plot_runs", "RECIPES", "Recipe", "get_recipe"]
