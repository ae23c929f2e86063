"""Per step, the draft tokens of a request, and when to stop proposing for a while (when it does not pay)."""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.engine.sampling import token_array
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.spec_decode.config import SpeculativeConfig
from nanovllm.engine.spec_decode.ngram import propose_ngram

# A draft rejected outright costs a step of k + 1 rows for one token: after one, the request decodes plainly
# for 1, 2, 4, ... steps (up to this many) before proposing again; an accepted draft resets the pause.
MAX_PAUSE_STEPS = 32


@dataclass
class SpecState:
    """A request's speculation history (kept in its Sequence's extras)."""

    pause: int = 0  # steps left without proposing
    next_pause: int = 1  # the pause after the next draft rejected outright


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Draft tokens for seq's next step (at most ``max_tokens``); [] to decode plainly."""
        extras = seq.extras
        state = extras.spec_state
        if state is None:
            state = extras.spec_state = SpecState()
        if state.pause > 0:
            state.pause -= 1
            return []
        num = min(self.config.num_speculative_tokens, max_tokens)
        if num < 1:
            return []
        config = self.config
        return propose_ngram(token_array(seq), num, config.prompt_lookup_min, config.prompt_lookup_max).tolist()

    def may_propose(self, seq: Sequence) -> bool:
        """Whether seq could get a draft next step (it is not pausing)."""
        state = seq.extras.spec_state
        return state is None or state.pause == 0

    @staticmethod
    def pass_step(seq: Sequence) -> None:
        """seq decodes plainly in a step planned without asking for a draft (a pause step)."""
        state = seq.extras.spec_state
        if state is not None and state.pause > 0:
            state.pause -= 1

    @staticmethod
    def observe(seq: Sequence, num_accepted: int) -> None:
        """The verify step kept ``num_accepted`` of seq's draft tokens."""
        state = seq.extras.spec_state
        if num_accepted == 0:
            state.pause = state.next_pause
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE_STEPS)
        else:
            state.next_pause = 1
