"""The replay queue between the group stream and the learner (replay_queue, with its ticket slots in
slots), what it knows of each generator (registry), the dispatcher that grants prompts to
generators (dispatch, with its slot indexes in holdings), the interface the learner takes
groups through (sources), and the divergence-gated admission bound's control law (bound_control)."""
