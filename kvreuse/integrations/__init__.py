"""kvreuse inside other serving engines. Each integration imports its engine itself; kvreuse never does."""
