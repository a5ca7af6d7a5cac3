"""The recipe as flows and tasks pass it, typed again before anything reads it.

Prefect flows and tasks take the recipe, or a section of it, as plain data: Prefect stores parameters and keys
its cache on them. A task reads none of that data directly: it rebuilds the typed recipe with `load_recipe`'s
own checks (`trainer.typed_config.build` on `trainer.recipe.Recipe`), so that every default and bound lives in
trainer/recipe.py alone and a stale or hand-written dict is refused naming the key it got wrong.
"""

from __future__ import annotations

from trainer.recipe import Recipe
from trainer.typed_config import build

SOURCE = "<pipeline recipe>"


def typed_recipe(recipe: Recipe | dict) -> Recipe:
    """`recipe` as a `Recipe` (built from its `to_dict()` form when it is one)."""
    return recipe if isinstance(recipe, Recipe) else build(Recipe, recipe, SOURCE)


def typed_section(name: str, section: dict):
    """The recipe section `name` (`"data"`, `"eval"`, ...) from its `to_dict()` form, as its dataclass."""
    return getattr(build(Recipe, {name: section}, SOURCE), name)
