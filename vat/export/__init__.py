"""Draft checkpoints (vat format; DFlash drafts in DFlash's release layout) and exporters / importers for SGLang and
vLLM speculators (``docs/export.md``).

Importing this package registers every layout with :mod:`vat.export.checkpoint` (each layout module depends on that
one module only), so :func:`load_draft` reads all of them.
"""

from vat.export.checkpoint import detect_format, load_draft, read_draft_config, save_draft
from vat.export.cli import export_draft
from vat.export.dflash import export_dflash, load_dflash, save_dflash
from vat.export.init_from import init_draft_from
from vat.export.sglang import export_sglang, sglang_config_dict
from vat.export.speculators import export_speculators, speculators_config_dict
from vat.target.conventions import (
    VAT_AUX_CONVENTION,
    sglang_to_vat_aux_ids,
    vat_to_hf_hidden_states_index,
    vat_to_sglang_aux_ids,
    vat_to_vllm_aux_ids,
    vllm_to_vat_aux_ids,
)

__all__ = [
    "VAT_AUX_CONVENTION",
    "detect_format",
    "export_dflash",
    "export_draft",
    "export_sglang",
    "export_speculators",
    "init_draft_from",
    "load_dflash",
    "load_draft",
    "read_draft_config",
    "save_dflash",
    "save_draft",
    "sglang_config_dict",
    "sglang_to_vat_aux_ids",
    "speculators_config_dict",
    "vat_to_hf_hidden_states_index",
    "vat_to_sglang_aux_ids",
    "vat_to_vllm_aux_ids",
    "vllm_to_vat_aux_ids",
]
