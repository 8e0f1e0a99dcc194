"""`make reproduce-<paper>`: one module per paper, each a `main(r: moeflow.report.Recipe)` plus TITLE and INTRO.

Run as `python -m recipes.reproduce PAPER [--quick] [--device cuda]` from the repository root.
"""

PAPERS = {
    "expertflow": "recipes.reproduce.expertflow",
    "casmoe": "recipes.reproduce.casmoe",
    "moe-gps": "recipes.reproduce.moe_gps",
    "speculating-experts": "recipes.reproduce.speculating_experts",
    "specmd": "recipes.reproduce.specmd",
}
