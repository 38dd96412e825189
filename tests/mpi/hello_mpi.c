/* An MPI program that exercises what tether's PMI server must wire up: MPI_Init (PMI-1 put,
 * get, barriers), MPI_Allreduce, a ring MPI_Sendrecv, MPI_Barrier, MPI_Finalize.
 *
 * Test hooks (environment):
 *   HELLO_DIE_RANK=R    rank R exits 3 before MPI_Init
 *   HELLO_WAIT_FILE=P   rank 0 waits until file P exists before MPI_Init, so the other ranks
 *                       are held in the PMI barrier meanwhile
 *   HELLO_ABORT_RANK=R  rank R calls MPI_Abort(MPI_COMM_WORLD, 5) after MPI_Init
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    const char *r = getenv("PMI_RANK");
    int env_rank = r ? atoi(r) : -1;
    const char *die = getenv("HELLO_DIE_RANK");
    const char *wait_file = getenv("HELLO_WAIT_FILE");
    if (die && env_rank == atoi(die))
        return 3;
    if (wait_file && env_rank == 0)
        while (access(wait_file, F_OK) != 0)
            usleep(10000);
    MPI_Init(&argc, &argv);
    int rank, size, one = 1, sum = 0, got = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *abort_rank = getenv("HELLO_ABORT_RANK");
    if (abort_rank && rank == atoi(abort_rank))
        MPI_Abort(MPI_COMM_WORLD, 5);
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    MPI_Sendrecv(&rank, 1, MPI_INT, right, 0, &got, 1, MPI_INT, left, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    MPI_Barrier(MPI_COMM_WORLD);
    int ok = sum == size && got == left;
    printf("rank %d of %d %s (sum %d, from %d)\n", rank, size, ok ? "OK" : "BAD", sum, got);
    fflush(stdout);
    MPI_Finalize();
    return ok ? 0 : 1;
}
