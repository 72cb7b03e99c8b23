"""Tests of `actors/holder/`: the session holder and its parts."""
