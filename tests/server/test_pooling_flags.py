"""The pooling flags: --runner, --convert, --task and --override-pooler-config reach the model
configuration; what the pooling runner does not do stops start-up in one line naming the flag."""

from __future__ import annotations

import pytest
from test_flags import parse, serve_error

from llmrpc.server import options


def test_pooling_flags_reach_the_model_config():
    engine, _ = options.build_configs(
        parse(
            *("--runner", "pooling", "--convert", "embed", "--task", "embed"),
            *("--override-pooler-config", '{"pooling_type": "MEAN", "normalize": false}'),
        )
    )
    model = engine.model
    assert (model.runner, model.convert, model.task) == ("pooling", "embed", "embed")
    assert model.override_pooler_config == {"pooling_type": "MEAN", "normalize": False}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--convert", "classify"), "--convert classify: classification and reward models"),
        (("--convert", "reward"), "--convert reward: classification and reward models"),
        (("--runner", "draft"), "--runner draft: this build runs a draft model inside"),
        (("--task", "score"), "--task score: this build serves generate and embed"),
        (("--override-pooler-config", '{"softmax": true}'), "unknown key(s) 'softmax'"),
        (("--override-pooler-config", '{"pooling_type": "MAX"}'), "LAST, MEAN, CLS"),
    ],
)
def test_what_pooling_does_not_do_is_one_line(capsys, argv, message):
    assert message in serve_error(capsys, *argv)
