from __future__ import annotations

import pytest

from controlplane.profiles.diff import diff_fields
from controlplane.profiles.models import Profile, ProfileRevision
from tests.controlplane.factories import enroll_worker, make_pool, make_profile
from workers.profile import EngineProfile, ProfileError

pytestmark = pytest.mark.django_db


def test_each_edit_adds_the_next_revision_and_keeps_the_old_one() -> None:
    first = make_profile("edits", max_num_batched_tokens=512)
    second = first.profile.add_revision({"max_num_batched_tokens": 1024})
    third = first.profile.add_revision({"max_num_batched_tokens": 2048})
    assert [r.revision for r in first.profile.revisions.order_by("revision")] == [1, 2, 3]
    first.refresh_from_db()
    assert first.fields["max_num_batched_tokens"] == 512
    assert (second.revision, third.revision) == (2, 3)
    assert first.profile.latest_revision() == third


def test_a_revision_cannot_be_changed_in_place() -> None:
    revision = make_profile()
    revision.comment = "rewritten history"
    with pytest.raises(ValueError, match="immutable"):
        revision.save()


def test_revision_stores_every_knob_and_rebuilds_the_engine_profile() -> None:
    revision = make_profile(max_num_batched_tokens=256, long_prefill_token_threshold=64)
    assert set(revision.fields) == set(EngineProfile.field_names())
    assert revision.engine_profile() == EngineProfile(max_num_batched_tokens=256, long_prefill_token_threshold=64)


def test_diff_lists_only_changed_fields_in_contract_order() -> None:
    a = make_profile("diffed", max_num_batched_tokens=512)
    b = a.profile.add_revision({"max_num_batched_tokens": 2048, "prefill_mode": "monolithic"})
    changes = [(c.field, c.before, c.after) for c in a.diff(b)]
    assert changes == [("prefill_mode", "chunked", "monolithic"), ("max_num_batched_tokens", 512, 2048)]
    assert len(a.diff(b, include_unchanged=True)) == len(EngineProfile.field_names())


def test_any_two_revisions_of_different_profiles_can_be_diffed() -> None:
    a = make_profile(max_num_seqs=32)
    b = make_profile(max_num_seqs=16)
    assert [(c.field, c.before, c.after) for c in a.diff(b)] == [("max_num_seqs", 32, 16)]


def test_diff_of_unknown_keys_sorts_them_after_the_contract_fields() -> None:
    rows = diff_fields({"zeta": 1}, {"alpha": 2, "max_num_seqs": 8})
    assert [r.field for r in rows] == ["max_num_seqs", "alpha", "zeta"]


@pytest.mark.parametrize(
    ("fields", "engine_kind", "bad_field"),
    [
        ({"max_num_batched_tokens": 32, "max_num_seqs": 64}, "reference", "max_num_batched_tokens"),
        (
            {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 512},
            "reference",
            "long_prefill_token_threshold",
        ),
        ({"max_num_seqs": 0}, "reference", "max_num_seqs"),
        ({"block_size": -16}, "reference", "block_size"),
        ({"short_prompt_threshold": 64}, "vllm", "short_prompt_threshold"),
        ({"min_prefill_tokens_per_step": 16}, "vllm", "min_prefill_tokens_per_step"),
    ],
)
def test_add_revision_refuses_a_profile_that_breaks_the_engine_contract(
    fields: dict, engine_kind: str, bad_field: str
) -> None:
    profile = Profile.objects.create(name="bad", engine_kind=engine_kind)
    with pytest.raises(ProfileError) as caught:
        profile.add_revision(fields)
    assert bad_field in caught.value.errors
    assert not ProfileRevision.objects.filter(profile=profile).exists()


def test_monolithic_edit_is_checked_against_the_longest_model_that_runs_the_profile() -> None:
    revision = make_profile("mono", prefill_mode="monolithic", max_num_batched_tokens=4096)
    pool = make_pool(revision=revision)
    enroll_worker(pool=pool, max_model_len=4096)
    with pytest.raises(ProfileError) as caught:
        revision.profile.add_revision({"prefill_mode": "monolithic", "max_num_batched_tokens": 2048})
    assert "max length (4096)" in caught.value.errors["max_num_batched_tokens"][0]
