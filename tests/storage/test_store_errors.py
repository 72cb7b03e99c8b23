"""The mistakes of a bucket's set-up that no server is needed to make: no credentials,
an endpoint where no server answers, a scheme with no store. Each is one line that
names what to set.
(A missing bucket and refused credentials, against real servers:
tests/storage/test_object_folder.py.)"""

from __future__ import annotations

import os
import socket

import pytest

from nemo_ckpt.catalog.listing import list_snapshots
from nemo_ckpt.cli.main import main
from nemo_ckpt.errors import CheckpointPathError, SnapshotWriteError
from nemo_ckpt.storage.checkpoint_folder import PROBE_DIR, folder_at
from tests.storage.test_object_folder import session, write_snapshot

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No store's variables at all (neither S3's nor Azure's)."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "AZURE_", "AZURITE_")):
            monkeypatch.delenv(k)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_without_credentials_the_cli_says_which_variables_to_set(
        no_aws_environment: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "s3://some-bucket/run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "no credentials for s3://some-bucket: set AWS_ACCESS_KEY_ID and " \
           "AWS_SECRET_ACCESS_KEY" in err
    assert "permissions" not in err


def test_without_an_azure_account_the_cli_says_which_variables_to_set(
        no_aws_environment: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "az://some-container/run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "no credentials for az://some-container: set AZURE_STORAGE_ACCOUNT_NAME and " \
           "AZURE_STORAGE_ACCOUNT_KEY" in err


def test_a_scheme_nemo_ckpt_has_no_store_for_is_refused_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "gs://some-bucket/run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "gs:// is not a store nemo-ckpt reads or writes; use s3://" in err


@pytest.fixture
def dead_endpoint(no_aws_environment: None, monkeypatch: pytest.MonkeyPatch) -> str:
    """An S3 endpoint, with credentials, where no server answers."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k",
                 "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
                 "AWS_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(k, v)
    return endpoint


def test_an_endpoint_where_no_server_answers_is_named_in_one_line(
        dead_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = dead_endpoint
    assert main(["verify", "s3://ckpt/run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"no server answers at {endpoint} for s3://ckpt; check AWS_ENDPOINT_URL" in err
    with pytest.raises(SnapshotWriteError) as caught:
        write_snapshot("s3://ckpt/run", {"holder-0": [session("holder-0", "a")]})
    assert str(caught.value).endswith(f"no server answers at {endpoint} for s3://ckpt; "
                                       f"check AWS_ENDPOINT_URL's host and port")


def test_a_startup_probe_gives_up_on_a_dead_server_after_two_retries_where_a_write_tries_ten(
        dead_endpoint: str) -> None:
    # check_startup's probe must answer within the holder call's deadline, so it names
    # the server nobody reaches rather than a holder too slow to answer.
    endpoint = dead_endpoint
    causes = {}
    for probe in (True, False):
        with pytest.raises(SnapshotWriteError) as caught:
            folder_at(f"s3://ckpt/{PROBE_DIR}", probe=probe).write_bytes("p", b"x")
        assert str(caught.value).endswith(f"no server answers at {endpoint} for s3://ckpt; "
                                          f"check AWS_ENDPOINT_URL's host and port")
        causes[probe] = str(caught.value.__cause__)
    assert "max_retries: 2," in causes[True], causes[True]
    assert "max_retries: 10," in causes[False], causes[False]


def test_a_plain_http_endpoint_without_aws_allow_http_says_to_set_it(
        dead_endpoint: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    told = (f"the endpoint {dead_endpoint} for s3://ckpt is plain http, which the store's "
            f"client refuses unless AWS_ALLOW_HTTP=true is set: set it on every node and "
            f"the driver, or use an https:// endpoint")
    for argv in (["ls", "s3://ckpt/run"], ["inspect", "s3://ckpt/run"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and told in err, err
        assert "builder error" not in err
    with pytest.raises(CheckpointPathError) as listing:
        list_snapshots("s3://ckpt/run")
    assert str(listing.value).endswith(told)
    with pytest.raises(SnapshotWriteError) as writing:
        write_snapshot("s3://ckpt/run", {"holder-0": [session("holder-0", "a")]})
    assert str(writing.value).endswith(told)
