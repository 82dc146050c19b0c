"""The functions the task YAMLs here name with `!function` (lm-eval imports this file by its path)."""

from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_choice, doc_to_target, doc_to_text  # noqa: F401

from prunetool.evaluation.local_data import (  # noqa: F401
    arc_challenge, arc_easy, lambada_openai, piqa, wikitext, winogrande,
)
