"""prepare's replay of prompt lookup: what the device would have drafted at each published row and
how much of it the tokens that followed accept (no device, no gRPC)."""

from __future__ import annotations

from stageserve.prepare.draft_replay import DraftReplay


def test_each_decode_row_is_judged_once_the_tokens_after_it_are_published():
    replay = DraftReplay([1, 2, 3, 4, 9, 1, 2], num_drafts=3)
    assert replay.publish([3], decode_row=False) == []  # the prompt row's token: nothing drafted there
    # A decode row at [..., 1, 2, 3]: lookup drafts [4, 9, 1]; two tokens follow so far.
    assert replay.publish([4, 9], decode_row=True) == []
    # The next row (at [..., 3, 4, 9]: drafts [1, 2, 3]) emits 5: the first row's third draft (1) was wrong.
    assert replay.publish([5], decode_row=True) == [(3, 2)]
    # The third row (at [..., 9, 5]: 5 occurred nowhere before) drafts nothing: judged at once.
    assert replay.publish([7, 7, 7], decode_row=True) == [(3, 0), (0, 0)]  # the second row's [1, 2, 3] against [5, 7, 7]
    # The fourth (at [..., 7, 7, 7]: [7] followed [7, 7] just before) drafts [7]; 8 followed.
    assert replay.publish([8], decode_row=True) == [(1, 0)]
