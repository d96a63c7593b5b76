"""The pure core shared by every decoding loop (generate, the engine, training and online).

- :mod:`.acceptance`: the acceptance rules (greedy prefix, speculative sampling) and their math;
- :mod:`.verify`: :func:`~.verify.accept_block`, the one verify-and-accept step of a round;
- :mod:`.length`: how many drafts a round verifies: the policy names and :class:`~.length.LengthSettings`, one rule
  class per policy, the round cost model and :class:`~.length.LengthPlanner`, which every loop asks each round;
- :mod:`.prompt_ngrams`: prompt lookup's candidate beside the drafter's block (the ``agree`` rule);
- :mod:`.rounds`: :class:`~.rounds.VerifiedRound`, :class:`~.rounds.FinishedRequest`, the sink, tau;
- :mod:`.hooks`: how an observer (the online adapter) reaches the loops that draft with a drafter.
"""
