"""Grammar-constrained decoding: the backend seam (`base`), the llguidance backend, and the
asynchronous, cached compiler the scheduler owns."""

from radixrt.core.sampling_params import SamplingParams
from radixrt.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, bitmask_words
from radixrt.grammar.compiler import GrammarCompiler
from radixrt.grammar.llguidance_backend import LLGuidanceBackend, check_grammar

__all__ = ["GrammarBackend", "GrammarCompiler", "GrammarError", "GrammarMatcher",
           "LLGuidanceBackend", "bitmask_words", "check_grammar", "check_params"]


def check_params(sp: SamplingParams) -> None:
    """`check_grammar` on the request's grammar, if it has one (the frontends' request path):
    `GrammarError` names the SamplingParams field."""
    key = sp.grammar_key
    if key is not None:
        check_grammar(*key)
