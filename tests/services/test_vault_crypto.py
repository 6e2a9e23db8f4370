"""The vault's sealed boxes opened with the key pair's stored public half, as uploads and injections do."""

from __future__ import annotations

import nacl.public
import pytest

from services.vault import crypto


def test_a_value_opens_with_its_key_pair_given_the_public_half() -> None:
    private, public = crypto.new_key_pair()
    sealed = nacl.public.SealedBox(nacl.public.PublicKey(public)).encrypt(b"hf_token")
    assert crypto.unseal(private, sealed, public) == b"hf_token"
    assert crypto.unseal(private, sealed) == b"hf_token"


def test_a_public_half_of_another_key_pair_opens_nothing() -> None:
    private, public = crypto.new_key_pair()
    _, other = crypto.new_key_pair()
    sealed = crypto.seal(public, b"hf_token")
    with pytest.raises(crypto.OpenFailed):
        crypto.unseal(private, sealed, other)
    with pytest.raises(crypto.OpenFailed):
        crypto.unseal(private, sealed[:-1], public)
