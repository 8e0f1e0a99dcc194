"""CasMoE's prompt-level cascade planner: EP labels, EAM (matcher), EAP (predictor), the gate."""

from .gate import DEFAULT_EPS, CascadePlanner, Plan, evaluate_plans, fit_eam, fit_eap
from .labels import ep_from_routing, ep_labels, normalize, prompt_texts

__all__ = [
    "DEFAULT_EPS",
    "CascadePlanner",
    "Plan",
    "ep_from_routing",
    "ep_labels",
    "evaluate_plans",
    "fit_eam",
    "fit_eap",
    "normalize",
    "prompt_texts",
]
