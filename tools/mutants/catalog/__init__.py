"""Every mutant, by area. To add one: a few lines in an area file (or a new area file added
to ``ALL`` here): ``mutant(name, guarantee, edit(path, old, new), ..., tests=...)``."""

from tools.mutants.catalog import (
    adapters,
    families,
    gemma_moe,
    hardening,
    kvcache,
    scheduling,
    service,
)
from tools.mutants.mutant import Mutant

ALL: tuple[Mutant, ...] = (
    *kvcache.MUTANTS,
    *service.MUTANTS,
    *scheduling.MUTANTS,
    *hardening.MUTANTS,
    *families.MUTANTS,
    *gemma_moe.MUTANTS,
    *adapters.MUTANTS,
)
