"""When the commands that load models ask glibc for huge pages (llama/hugepages.py)."""

from __future__ import annotations

from homespec.llama.hugepages import TUNABLE, thp_mode, tunables_with_huge_pages

GLIBC = ("glibc", "2.36")


def test_glibc_is_asked_for_huge_pages_where_the_kernel_gives_them_only_on_request():
    assert tunables_with_huge_pages({}, "madvise", GLIBC) == f"{TUNABLE}=1"


def test_the_users_own_tunables_are_kept_and_their_own_hugetlb_choice_wins():
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC) == (
        f"glibc.malloc.arena_max=2:{TUNABLE}=1")
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, "madvise", GLIBC) is None
    # the value this module sets: a process started with it does not run again
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": f"{TUNABLE}=1"}, "madvise", GLIBC) is None


def test_nothing_changes_where_it_would_change_nothing_or_is_turned_off():
    assert tunables_with_huge_pages({}, "always", GLIBC) is None  # every mapping gets them already
    assert tunables_with_huge_pages({}, "never", GLIBC) is None
    assert tunables_with_huge_pages({}, None, GLIBC) is None  # no THP in this kernel
    assert tunables_with_huge_pages({}, "madvise", ("glibc", "2.34")) is None  # no such tunable yet
    assert tunables_with_huge_pages({}, "madvise", ("", "")) is None  # musl: not glibc
    assert tunables_with_huge_pages({"HOMESPEC_HUGEPAGES": "0"}, "madvise", GLIBC) is None


def test_the_kernels_thp_setting_is_the_bracketed_word(tmp_path, monkeypatch):
    import homespec.llama.hugepages as hp

    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hp, "_THP", f)
    assert thp_mode() == "madvise"
    monkeypatch.setattr(hp, "_THP", tmp_path / "missing")
    assert thp_mode() is None
