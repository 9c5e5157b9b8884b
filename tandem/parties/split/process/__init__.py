"""Split learning as a process: a party's TOML (`config`), what it builds (`build`,
`build_data`, `party_data`), the session that reaches its peers and agrees a spec
(`session`, `notice`), the job driver (`standalone.run_party`), `tandem predict`
(`predict_cli`), the demo and the `tandem party` command line (`cli`, `cli_report`).

The library core (`tandem.parties.split`: `SplitParty`, the spec and its negotiation, cut
compression, checkpoints, reporting, the inference protocol) runs over any transport and reads
no TOML; it never imports this package (tests/test_import_graph.py checks it).
"""
