

def test_worker_refuses_a_task_count_that_is_not_the_plans(planned, monkeypatch, capsys):
    """Before any process group: a world-4 plan started as 2 SLURM tasks, or with no store."""
    from harness.backends import worker

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", NODE_ENV):
        monkeypatch.delenv(k, raising=False)
    plan = str(planned / "launches" / "plan-w4-0.json")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert worker.main([plan]) == 2
    assert "needs world size 4, launched with 2" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.delenv("MASTER_PORT")
    assert worker.main([plan]) == 2
    assert "set MASTER_PORT" in capsys.readouterr().err
