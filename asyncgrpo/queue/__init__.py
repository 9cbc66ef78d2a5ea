"""The replay queue between the group stream and the learner (replay_queue), what it knows of each
generator (registry), and the dispatcher that grants prompts to generators (dispatch)."""
