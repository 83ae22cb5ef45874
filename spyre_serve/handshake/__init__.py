"""The block-count handshake: each card's memory and compiler report (card, compiler_report)
and the coordinator that takes the minimum over ranks and checks a full request fits."""
