"""Datasets the project generates itself, so the main job needs nothing downloaded."""

from .burgers import burgers_dataset, solve_burgers

__all__ = ["burgers_dataset", "solve_burgers"]
