"""Aux-layer id conventions. The off-by-one between engines is the most common cross-engine bug: keep it here.

All three conventions name the same three tensors; only the numbers differ.

==========================  ==========================================  =====================================
convention                  an id i means                                 EAGLE-3 default, L target layers
==========================  ==========================================  =====================================
vat (this repo)             output of decoder layer i (0-indexed)         ``[1, L//2 - 1, L - 4]``
HF ``output_hidden_states`` ``hidden_states[i]``: output of layer i - 1   ``[2, L//2, L - 3]``
SGLang draft config         output of layer i (SGLang captures at the     ``[1, L//2 - 1, L - 4]``
(``eagle_config.eagle_aux_  input of layer i + 1 internally)
hidden_state_layer_ids``)
vLLM / speculators          input of layer i = output of layer i - 1     ``[2, L//2, L - 3]``
(``eagle_aux_hidden_state_
layer_ids``)
==========================  ==========================================  =====================================

So vat -> SGLang is the identity and vat -> vLLM is ``+1``.
"""

from __future__ import annotations

from collections.abc import Sequence

VAT_AUX_CONVENTION = "layer_output_0_indexed"
VAT_AUX_CONVENTION_NOTE = (
    "aux_layer_ids are 0-indexed decoder-layer OUTPUTS (HF output_hidden_states index = id + 1); "
    "SGLang eagle_config ids = the same numbers; vLLM/speculators eagle_aux_hidden_state_layer_ids = id + 1"
)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default low / mid / high layers in vat's convention: ``[1, L//2 - 1, L - 4]``, clamped into range.

    Clamping only matters for tiny targets (L < 5), where ids may repeat; the draft still gets three slots.
    """
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    return [min(max(i, 0), num_layers - 1) for i in ids]


def vat_to_sglang_aux_ids(ids: Sequence[int]) -> list[int]:
    """vat ids -> SGLang draft-config ids (identity: both name layer outputs)."""
    return [int(i) for i in ids]


def sglang_to_vat_aux_ids(ids: Sequence[int]) -> list[int]:
    """SGLang draft-config ids -> vat ids (identity)."""
    return [int(i) for i in ids]


def vat_to_vllm_aux_ids(ids: Sequence[int]) -> list[int]:
    """vat ids -> vLLM / speculators ids (``+1``: vLLM names the layer whose input it captures)."""
    return [int(i) + 1 for i in ids]


def vllm_to_vat_aux_ids(ids: Sequence[int]) -> list[int]:
    """vLLM / speculators ids -> vat ids (``-1``)."""
    return [int(i) - 1 for i in ids]


def vat_to_hf_hidden_states_index(ids: Sequence[int]) -> list[int]:
    """vat ids -> indices into HF ``output_hidden_states`` (``+1``; index 0 is the embedding output)."""
    return [int(i) + 1 for i in ids]
