"""Every mutant, by area. To add one: a few lines in an area file (or a new area file added
to ``ALL`` here): ``mutant(name, guarantee, edit(path, old, new), ..., tests=...)``."""

from tools.mutants.catalog import fairness, gemma_moe, hardening, kvcache, lora, models, service
from tools.mutants.mutant import Mutant

ALL: tuple[Mutant, ...] = (
    *kvcache.MUTANTS,
    *service.MUTANTS,
    *fairness.MUTANTS,
    *hardening.MUTANTS,
    *models.MUTANTS,
    *gemma_moe.MUTANTS,
    *lora.MUTANTS,
)
